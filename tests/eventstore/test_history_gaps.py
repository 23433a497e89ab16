"""Loads never return a history with a hole: streams damaged by deletes, purges and forged commits.

The stream here is created before the store connects, with deletes and purges allowed (as a stream that was
damaged before it was locked, or restored outside jetsourcing, is): ``EventStore.connect(create_stream=False)``
reads it as any store would. Each damage is tried on both load paths: a dense entity (its commits close
together: one ``next_by_subj`` scan) and a sparse one (other entities' messages between its commits: the walk
of its back pointers).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import pytest

from eventstore import (
    ANY,
    NO_STREAM,
    EventDecodeError,
    ServerUnavailableError,
    EventStore,
    EventStoreSettings,
    HistoryGapError,
    StreamId,
)
from eventstore.wire import Header, encode_commit, utc_now_text

from tests.support.damage import damageable_store
from tests.support.noise import noise
from tests.support.proxy import Proxy

from .events import ALL, Deposited

PATHS = ["dense", "sparse"]


@pytest.fixture
async def store(settings: EventStoreSettings) -> AsyncIterator[EventStore]:
    store = await damageable_store(settings)
    for model in ALL:
        store.registry.register(model)
    try:
        yield store
    finally:
        await store.close()


async def fresh(store: EventStore) -> EventStore:
    """Another store on the same stream that knows nothing of its entities (as a new process)."""
    other = await EventStore.connect(store.settings, create_stream=False)
    for model in ALL:
        other.registry.register(model)
    return other


async def history(store: EventStore, path: str, commits: int = 12) -> tuple[StreamId, list[int]]:
    """A new entity of ``commits`` one-event commits (versions 1..commits), dense or sparse; their positions."""
    entity = StreamId("Account", f"{path}-{uuid.uuid4().hex[:8]}")
    positions = []
    for version in range(1, commits + 1):
        positions.append((await store.append(entity, [Deposited(amount=version)], version - 1 or NO_STREAM)).position)
        if path == "sparse":
            await noise(store)
    return entity, positions


async def raw_commit(store: EventStore, entity: StreamId, version: int, **extra: str) -> int:
    """Publish one commit of our layout (plus ``extra`` headers) with plain nats-py, as another program would."""
    headers, body = encode_commit(
        msg_id=uuid.uuid4().hex, types=["Deposited"], schema_versions=[1], event_ids=[uuid.uuid4().hex],
        payloads=[Deposited(amount=version).model_dump_json().encode()], last_version=version,
        recorded_at=utc_now_text(),
    )
    headers.update(extra)
    ack = await store.nc.jetstream().publish(entity.subject(store.settings.subject_prefix), body, headers=headers)
    return ack.seq


@pytest.mark.parametrize("path", PATHS)
async def test_a_deleted_commit_is_a_typed_error_naming_the_missing_version(store: EventStore, path: str) -> None:
    entity, positions = await history(store, path)
    assert await store.nc.jetstream().delete_msg(store.settings.stream, positions[4])  # version 5
    for reader in (store, await fresh(store)):
        with pytest.raises(HistoryGapError, match="version 5 was due: version 5 is missing") as caught:
            await reader.read(entity)
        assert (caught.value.stream_id, caught.value.position, caught.value.version) == (entity, positions[5], 5)
        assert f"position {positions[5]} on {entity}" in str(caught.value)
        with pytest.raises(HistoryGapError):  # the same read through the leader finds the same hole
            await reader.read(entity, consistent=True)
        # A read from a position after the hole (a snapshot's) is whole, and so is a time travel before it.
        assert [e.version for e in await reader.read(entity, from_position=positions[6])] == list(range(7, 13))
        with pytest.raises(HistoryGapError):
            await reader.read(entity, from_version=5, from_position=positions[3])
        if reader is not store:
            await reader.close()


@pytest.mark.parametrize("path", PATHS)
async def test_nothing_is_appended_on_an_entity_a_load_found_broken(store: EventStore, path: str) -> None:
    entity, positions = await history(store, path, 6)
    assert await store.nc.jetstream().delete_msg(store.settings.stream, positions[2])  # version 3
    with pytest.raises(HistoryGapError):
        await store.read(entity)
    last = (await store.info()).last_position
    # What this store knew of the entity (it wrote it) is forgotten: nothing builds on the broken history.
    calls = [lambda: store.version(entity), lambda: store.append(entity, [Deposited(amount=7)], ANY),
             lambda: store.append(entity, [Deposited(amount=7)], 6)]
    for call in calls:
        with pytest.raises(HistoryGapError, match=f"on {entity}"):
            await call()
    assert (await store.info()).last_position == last
    # Another entity is not affected.
    whole, _ = await history(store, "dense", 2)
    assert (await store.append(whole, [Deposited(amount=3)], ANY)).last_version == 3


@pytest.mark.parametrize("path", PATHS)
async def test_a_purged_start_is_a_typed_error(store: EventStore, path: str) -> None:
    js = store.nc.jetstream()
    kept, kept_positions = await history(store, path, 6)
    cut, cut_positions = await history(store, path, 6)
    subject = lambda e: e.subject(store.settings.subject_prefix)  # noqa: E731
    await js.purge_stream(store.settings.stream, subject=subject(kept), keep=2)  # only versions 5 and 6 are left
    await js.purge_stream(store.settings.stream, subject=subject(cut), seq=cut_positions[3])  # versions 4.. are left
    for entity, first in ((kept, kept_positions[4]), (cut, cut_positions[3])):
        with pytest.raises(HistoryGapError, match="but version 1 was due") as caught:
            await store.read(entity)
        assert (caught.value.position, caught.value.version) == (first, 1)


@pytest.mark.parametrize("path", PATHS)
async def test_a_forged_restart_is_detected_by_loads_version_and_append(store: EventStore, path: str) -> None:
    entity, positions = await history(store, path, 10)
    # A commit claiming to be the entity's first, published after version 10 with the expected sequence the
    # server checks (so it is stored).
    forged = await raw_commit(
        store, entity, 1, **{Header.PREVIOUS: "0", Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(positions[-1])}
    )
    other = await fresh(store)
    try:
        for reader in (store, other):
            with pytest.raises(HistoryGapError, match="forged") as caught:
                await reader.read(entity)
            assert caught.value.position == forged
        with pytest.raises(HistoryGapError, match="forged restart"):
            await other.version(entity)
        with pytest.raises(HistoryGapError):
            await other.append(entity, [Deposited(amount=11)], ANY)
        with pytest.raises(HistoryGapError):
            await store.append(entity, [Deposited(amount=11)], ANY)
    finally:
        await other.close()
    assert (await store.info()).last_position == forged  # nothing was appended on top of it


async def test_a_commit_without_recorded_at_is_a_typed_decode_error(store: EventStore) -> None:
    entity, positions = await history(store, "dense", 2)
    await raw_commit(store, entity, 3, **{Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(positions[-1])})
    headers, body = encode_commit(
        msg_id=uuid.uuid4().hex, types=["Deposited"], schema_versions=[1], event_ids=[uuid.uuid4().hex],
        payloads=[b'{"amount":4}'], last_version=4, recorded_at="",
    )
    del headers[Header.RECORDED_AT]
    bare = (await store.nc.jetstream().publish(entity.subject(store.settings.subject_prefix), body, headers=headers)).seq
    with pytest.raises(EventDecodeError, match=f"position {bare} on {entity}.*Es-Recorded-At"):
        [e.recorded_at for e in await store.read(entity)]
    with pytest.raises(EventDecodeError, match=f"position {bare} on {entity}.*Es-Recorded-At"):
        [e.recorded_at async for batch in store.read_all() for e in batch]


async def test_append_refuses_to_build_on_a_foreign_last_message(store: EventStore) -> None:
    entity, positions = await history(store, "dense", 3)
    # Another program's message that looks like a version but is no commit of ours.
    foreign = (await store.nc.jetstream().publish(
        entity.subject(store.settings.subject_prefix), b"{}", headers={Header.VERSION: "4"}
    )).seq
    other = await fresh(store)
    try:
        for call in (lambda: other.version(entity), lambda: other.append(entity, [Deposited(amount=5)], ANY)):
            with pytest.raises(EventDecodeError, match=f"position {foreign} on {entity}.*not written by jetsourcing"):
                await call()
    finally:
        await other.close()
    assert (await store.info()).last_position == foreign


async def test_a_batch_answer_missing_a_message_is_never_taken_for_a_shorter_history(store: EventStore) -> None:
    """The server chains the messages of a direct get batch (each names the one before): one lost on the way is
    seen, whichever it is, and an answer as the server sent it is whole."""
    from eventstore.jetstream.direct import _lost_reply

    entity, _ = await history(store, "dense", 4)
    subject = entity.subject(store.settings.subject_prefix)
    inbox, direct_get = store._inbox, store._appender.direct._subjects.direct_get()
    for request in ({"seq": 1, "next_by_subj": subject, "batch": 10}, {"multi_last": [subject], "batch": 1}):
        answer = await inbox.request(direct_get, json.dumps(request).encode(), 5.0, what="test", many=True)
        assert not _lost_reply(answer)
        for lost in range(len(answer) - 1):  # each data message in turn (the closing status ends the wait)
            assert _lost_reply(answer[:lost] + answer[lost + 1:]), (request, lost)


async def test_loads_over_a_connection_that_loses_replies_are_whole_or_fail(store: EventStore) -> None:
    """4% of the answers to the reader's requests lost on the way: each load is the whole history or a
    ServerUnavailableError (a lost closing status leaves the request unanswered), never a shorter history."""
    entities = [(await history(store, "dense", 10))[0] for _ in range(3)]
    async with Proxy(store.settings.nats_url or "") as proxy:
        settings = store.settings.model_copy(update={"nats_url": proxy.url, "request_timeout_s": 0.5})
        reader = await EventStore.connect(settings, create_stream=False)
        for model in ALL:
            reader.registry.register(model)
        try:
            proxy.drop_replies(0.04)
            whole = failed = 0
            for i in range(30):
                try:
                    events = await reader.read(entities[i % 3])
                except ServerUnavailableError:
                    failed += 1
                    continue
                assert [e.version for e in events] == list(range(1, 11)), i
                whole += 1
            proxy.drop_replies(0)
        finally:
            await reader.close()
    assert proxy.dropped > 5 and whole > 15, (proxy.dropped, whole, failed)

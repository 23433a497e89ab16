"""Cold loads: every commit points back to the entity's previous commits, and loads walk those pointers.

Entities here are spread through the stream by blocks of other messages longer
than the span a load would rather scan, so ``read`` walks the back pointers.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
from nats.aio.msg import Msg

from eventstore import ANY, NO_STREAM, EntityAppend, EventDecodeError, EventStore, StreamId
from eventstore.wire import PREVIOUS_COMMITS, Header, encode_commit, utc_now_text

from tests.support.noise import GAP, noise

from .events import Deposited

async def raw_commit(store: EventStore, stream_id: StreamId, version: int, **extra: str) -> int:
    """Publish one commit as a writer before back pointers did (or with ``extra`` headers); its position."""
    headers, body = encode_commit(
        msg_id=uuid.uuid4().hex, types=["Deposited"], schema_versions=[1], event_ids=[uuid.uuid4().hex],
        payloads=[Deposited(amount=version).model_dump_json().encode()], last_version=version,
        recorded_at=utc_now_text(),
    )
    headers.update(extra)
    ack = await store.nc.jetstream().publish(stream_id.subject(store.settings.subject_prefix), body, headers=headers)
    return ack.seq


async def pointers(store: EventStore, position: int) -> str | None:
    msg = await store.nc.jetstream().get_msg(store.settings.stream, seq=position, direct=True)
    return (msg.headers or {}).get(Header.PREVIOUS)


def expected_pointers(positions: list[int], index: int) -> str:
    """What the commit at ``positions[index]`` should point to: its predecessors, most recent first, 0 at the start."""
    earlier = [*positions[:index][::-1], 0][:PREVIOUS_COMMITS]
    return ",".join(map(str, earlier))


async def test_every_commit_points_back_to_the_entitys_previous_commits(store: EventStore) -> None:
    a, b = StreamId("Account", "a"), StreamId("Account", "b")
    positions: dict[StreamId, list[int]] = {a: [], b: []}
    for i in range(12):  # interleaved, with every kind of expectation and a multi-entity append
        if i % 4 == 0:
            result = await store.append(a, [Deposited(amount=i)], ANY)
        elif i % 4 == 1:
            version = await store.version(a)
            result = await store.append(a, [Deposited(amount=i)], version or NO_STREAM, idempotency_key=f"k{i}")
        elif i % 4 == 2:
            result = await store.append(a, [Deposited(amount=i), Deposited(amount=i)], ANY)
        else:
            result, other = await store.append_many(
                [EntityAppend(a, [Deposited(amount=i)]), EntityAppend(b, [Deposited(amount=i)])]
            )
            positions[b].append(other.position)
        positions[a].append(result.position)
    for entity, stored in positions.items():
        for index, position in enumerate(stored):
            assert await pointers(store, position) == expected_pointers(stored, index), (entity, index)

    # A store that knows nothing of the entity looks its last commit up, pointers included, for ANY.
    async with EventStore.connect(store.settings) as fresh:
        fresh.registry.register(Deposited)
        result = await fresh.append(a, [Deposited(amount=1)], ANY)
    positions[a].append(result.position)
    assert await pointers(store, result.position) == expected_pointers(positions[a], len(positions[a]) - 1)


async def test_a_spread_out_entity_loads_by_its_pointers_exactly_as_a_scan_reads_it(store: EventStore) -> None:
    entity = StreamId("Account", "spread")
    written = []
    for i in range(1, 20):
        events = [Deposited(amount=i)] * (1 + i % 3)
        expected = ANY if i % 2 else written[-1].last_version if written else NO_STREAM  # ANY and exact
        written.append(await store.append(entity, events, expected))
        await noise(store, GAP if i % 5 == 0 else 50)
    await noise(store)
    by_scan = await store._appender.entities.commits(entity, how="scan")
    by_chain = await store._appender.entities.commits(entity, how="chain")
    def commits(msgs: list[Msg]) -> list[tuple[str, str, bytes]]:
        return [((m.headers or {})[Header.SEQUENCE], (m.headers or {})[Header.MSG_ID], m.data) for m in msgs]

    assert commits(by_chain) == commits(by_scan) and len(by_scan) == len(written)
    events = await store.read(entity)
    assert [e.version for e in events] == list(range(1, written[-1].last_version + 1))
    assert [e.position for e in events if e.index == 0] == [w.position for w in written]
    # From a position (a snapshot's), and time travel.
    middle = written[9]
    assert await store.read(entity, from_position=middle.position) == [e for e in events if e.position >= middle.position]
    assert await store.read(entity, to_version=7) == events[:7]
    assert await store.read(entity, from_version=5, to_version=9, from_position=written[1].position) == events[4:9]


async def test_commits_written_before_back_pointers_still_load(store: EventStore) -> None:
    entity = StreamId("Account", "old")
    # Old layout: no Es-Previous; the first two without any pointer, the next two with the server-checked one.
    old = [await raw_commit(store, entity, 1)]
    await noise(store)
    old.append(await raw_commit(store, entity, 2))
    await noise(store)
    old.append(await raw_commit(store, entity, 3, **{Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(old[-1])}))
    await noise(store)
    old.append(await raw_commit(store, entity, 4, **{Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(old[-1])}))
    await noise(store)
    new = []
    for amount in (5, 6, 7):  # this version's commits on top
        new.append(await store.append(entity, [Deposited(amount=amount)], ANY))
        await noise(store)
    events = await store.read(entity)
    assert [(e.version, e.data) for e in events] == [(v, Deposited(amount=v)) for v in range(1, 8)]
    assert [e.position for e in events] == old + [n.position for n in new]
    # The old commit's server-checked pointer is all it tells of the entity's past.
    assert await pointers(store, new[0].position) == f"{old[-1]},{old[-2]}"
    assert await pointers(store, new[1].position) == f"{new[0].position},{old[-1]},{old[-2]}"


async def test_a_foreign_or_corrupt_pointer_is_a_typed_error_naming_the_position(store: EventStore) -> None:
    other = StreamId("Other", "x").subject(store.settings.subject_prefix)
    cases: list[tuple[Callable[[int, int], str], str]] = [
        # Another entity's message, and a skipped commit: the walk fails, the read through the leader finds the
        # commit's pointer naming another position than the entity's commit before it.
        (lambda one, two: f"{two + GAP + 1},{two},{one},0", "points back to position .*, but the entity's commit"),
        (lambda one, two: f"{one},0", "points back to position .*, but the entity's commit"),
        (lambda one, two: "not a position", "malformed back pointer"),
        (lambda one, two: f"{one},{two}", "malformed back pointer"),  # not decreasing
    ]
    for index, (pointer, message) in enumerate(cases):
        case = StreamId("Account", f"corrupt-{index}")
        one = await store.append(case, [Deposited(amount=1)], NO_STREAM)
        await noise(store)
        two = await store.append(case, [Deposited(amount=2)], 1)
        await noise(store)
        foreign = await store.nc.jetstream().publish(other, b"{}")
        assert foreign.seq == two.position + GAP + 1
        bad = await raw_commit(store, case, 3, **{Header.PREVIOUS: pointer(one.position, two.position)})
        await noise(store)
        with pytest.raises(EventDecodeError, match=message) as caught:
            await store.read(case)
        assert f"position {bad} on {case}" in str(caught.value)


async def test_loads_during_concurrent_writes_are_consistent_prefixes(store: EventStore) -> None:
    entity = StreamId("Account", "busy")
    await store.append(entity, [Deposited(amount=0)], NO_STREAM)
    stop = asyncio.Event()

    async def writer(n: int) -> None:
        for i in range(15):
            await store.append(entity, [Deposited(amount=n * 100 + i)], ANY)
            await noise(store, 1000)  # sparse: loads walk the pointers
        stop.set()

    loads = []

    async def loader() -> None:
        async with EventStore.connect(store.settings) as other:  # its own connection, no shared knowledge
            other.registry.register(Deposited)
            while not stop.is_set():
                loads.append(await other.read(entity))

    await asyncio.gather(writer(1), writer(2), loader())
    final = await store.read(entity)
    assert len(loads) > 3
    for load in loads:
        assert [e.version for e in load] == list(range(1, len(load) + 1))
        assert [(e.position, e.data) for e in load] == [(e.position, e.data) for e in final[: len(load)]]

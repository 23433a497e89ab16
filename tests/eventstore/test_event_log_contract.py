"""One contract for what aggregates need of an event store (:class:`EventLog`), run against the JetStream store on
a real nats-server and against :class:`InMemoryEventStore`, which domain tests may use instead."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from eventstore import (
    ANY,
    NO_STREAM,
    ConcurrencyError,
    EntityAppend,
    EventLog,
    EventStore,
    EventTooLargeError,
    InMemoryEventStore,
    InvalidArgumentError,
    InvalidEventError,
    InvalidStreamIdError,
    StreamId,
    UnknownEventTypeError,
)

from .events import ALL, Deposited, Note, Opened

ALICE = StreamId("Account", "alice")
BOB = StreamId("Account", "bob")


@pytest.fixture(params=["jetstream", "memory"])
def log(request: pytest.FixtureRequest) -> EventLog:
    if request.param == "jetstream":
        store: EventStore = request.getfixturevalue("store")
        return store
    memory = InMemoryEventStore()
    for model in ALL:
        memory.registry.register(model)
    return memory


async def _all(log: EventLog, **options: Any) -> list[tuple[int, str, int, str]]:
    return [(e.position, str(e.stream_id), e.version, e.type) async for batch in log.read_all(**options) for e in batch]


async def test_appends_number_versions_per_entity_and_positions_globally(log: EventLog) -> None:
    first = await log.append(ALICE, [Opened(owner="Alice"), Deposited(amount=5)], NO_STREAM)
    second = await log.append(BOB, [Opened(owner="Bob")], NO_STREAM)
    third = await log.append(ALICE, [Deposited(amount=7)], 2)
    assert (first.first_version, first.last_version, first.duplicate) == (1, 2, False)
    assert (second.position, third.position) == (first.position + 1, first.position + 2)
    assert (third.first_version, third.last_version, third.count) == (3, 3, 1)
    events = await log.read(ALICE)
    assert [(e.version, e.position, e.index, e.data) for e in events] == [
        (1, first.position, 0, Opened(owner="Alice")), (2, first.position, 1, Deposited(amount=5)),
        (3, third.position, 0, Deposited(amount=7)),
    ]
    assert len({e.event_id for e in events}) == 3 and all(e.recorded_at.tzinfo is not None for e in events)
    assert await log.version(ALICE) == 3 and (await log.state(ALICE)).position == third.position
    assert await log.version(StreamId("Account", "nobody")) == 0
    assert await log.last_position() == third.position


async def test_reads_by_version_range_and_position(log: EventLog) -> None:
    await log.append(ALICE, [Opened(owner="A"), Deposited(amount=1), Deposited(amount=2)], NO_STREAM)
    later = await log.append(ALICE, [Deposited(amount=3)], 3)
    assert [e.version for e in await log.read(ALICE, from_version=2, to_version=3)] == [2, 3]
    assert [e.version for e in await log.read(ALICE, from_position=later.position)] == [4]
    assert await log.read(StreamId("Account", "nobody")) == []


async def test_expected_versions_are_checked_and_a_conflict_stores_nothing(log: EventLog) -> None:
    await log.append(ALICE, [Opened(owner="A")], NO_STREAM)
    for expected in (NO_STREAM, 0, 2):
        with pytest.raises(ConcurrencyError) as caught:
            await log.append(ALICE, [Deposited(amount=1)], expected)
        assert caught.value.actual == 1 and caught.value.stream_id == ALICE
    assert (await log.append(ALICE, [Deposited(amount=1)], ANY)).last_version == 2
    assert await log.version(ALICE) == 2


async def test_an_append_to_several_entities_is_all_or_nothing(log: EventLog) -> None:
    await log.append(BOB, [Opened(owner="Bob")], NO_STREAM)
    with pytest.raises(ConcurrencyError):
        await log.append_many([EntityAppend(ALICE, [Opened(owner="A")], NO_STREAM),
                               EntityAppend(BOB, [Deposited(amount=1)], 5)])
    assert await log.read(ALICE) == [] and await log.version(BOB) == 1
    results = await log.append_many([EntityAppend(ALICE, [Opened(owner="A")], NO_STREAM),
                                     EntityAppend(BOB, [Deposited(amount=1)], 1)], correlation_id="transfer-1")
    assert [(r.stream_id, r.last_version) for r in results] == [(ALICE, 1), (BOB, 2)]
    assert [e.correlation_id for e in await log.read(BOB)] == [None, "transfer-1"]


async def test_an_idempotency_key_stores_once_and_answers_the_first_result(log: EventLog) -> None:
    first = await log.append(ALICE, [Opened(owner="A")], ANY, idempotency_key="cmd-1", causation_id="c")
    again = await log.append(ALICE, [Opened(owner="A")], ANY, idempotency_key="cmd-1", causation_id="c")
    assert again.duplicate and (again.position, again.first_version, again.last_version) == (
        first.position, first.first_version, first.last_version)
    assert await log.version(ALICE) == 1
    [event] = await log.read(ALICE)
    assert (event.idempotency_key, event.causation_id) == ("cmd-1", "c")
    found = await log.find_append(ALICE, "cmd-1")
    assert found is not None and (found.position, found.duplicate) == (first.position, True)
    assert await log.find_append(ALICE, "cmd-2") is None and await log.find_append(BOB, "cmd-1") is None
    with pytest.raises(InvalidEventError, match="already used"):
        await log.append(BOB, [Opened(owner="B")], ANY, idempotency_key="cmd-1")
    assert await log.version(BOB) == 0


async def test_a_note_is_stored_with_the_commit_and_handed_to_duplicates(log: EventLog) -> None:
    note = '{"value": "caf\u00e9 100%\\n"}'  # any text: escaped on the wire, read back exactly
    first = await log.append(ALICE, [Opened(owner="A")], NO_STREAM, idempotency_key="cmd-1", note=note)
    assert (first.duplicate, first.note) == (False, None)
    await log.append(ALICE, [Deposited(amount=1)], 1, idempotency_key="cmd-2")
    again = await log.append(ALICE, [Opened(owner="A")], NO_STREAM, idempotency_key="cmd-1", note="another")
    assert (again.position, again.duplicate, again.note) == (first.position, True, note)
    found = await log.find_append(ALICE, "cmd-1", from_position=first.position)
    assert found is not None and (found.position, found.note) == (first.position, note)
    assert await log.find_append(ALICE, "cmd-1", from_position=first.position + 1) is None
    found = await log.find_append(ALICE, "cmd-2")
    assert found is not None and found.note is None
    with pytest.raises(InvalidArgumentError, match="more than 4096"):
        await log.append(BOB, [Opened(owner="B")], NO_STREAM, note="%" * 1366)  # 3 bytes each, escaped
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        await log.append(BOB, [Opened(owner="B")], NO_STREAM, note="")
    await log.append(BOB, [Opened(owner="B")], NO_STREAM, note="%" * 1365)
    assert await log.version(BOB) == 1


async def test_read_all_gives_whole_commits_in_order_by_category(log: EventLog) -> None:
    await log.append(ALICE, [Opened(owner="A"), Deposited(amount=1)], NO_STREAM)
    await log.append(StreamId("Memo", "m1"), [Note(text="hi")], NO_STREAM)
    await log.append(BOB, [Opened(owner="B")], NO_STREAM)
    assert await _all(log) == [(1, "Account/alice", 1, "Opened"), (1, "Account/alice", 2, "Deposited"),
                               (2, "Memo/m1", 1, "Note"), (3, "Account/bob", 1, "Opened")]
    assert [p for p, *_ in await _all(log, categories=["Account"])] == [1, 1, 3]
    assert [p for p, *_ in await _all(log, from_position=2, to_position=2)] == [2]
    batches = [len(batch) async for batch in log.read_all(batch=1)]
    assert sum(batches) == 4 and all(n >= 1 for n in batches)


class Unregistered(BaseModel):
    x: int


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda log: log.append("Account/alice", [Opened(owner="A")]), InvalidArgumentError),
        (lambda log: log.append(ALICE, []), InvalidEventError),
        (lambda log: log.append(ALICE, [{"owner": "A"}]), InvalidEventError),
        (lambda log: log.append(ALICE, [Unregistered(x=1)]), UnknownEventTypeError),
        (lambda log: log.append(ALICE, [Opened(owner="A")], -1), InvalidArgumentError),
        (lambda log: log.append(ALICE, [Opened(owner="A")], "1"), InvalidArgumentError),
        (lambda log: log.append(ALICE, [Opened(owner="A")], idempotency_key=""), InvalidArgumentError),
        (lambda log: log.append(ALICE, [Opened(owner="A")], correlation_id="a\nb"), InvalidArgumentError),
        (lambda log: log.append(ALICE, [Opened(owner="x" * 2_000_000)]), EventTooLargeError),
        (lambda log: log.append_many([EntityAppend(ALICE, [Opened(owner="A")])] * 2), InvalidEventError),
        (lambda log: log.append_many("not a list"), InvalidArgumentError),  # type: ignore[arg-type]
        (lambda log: log.read(ALICE, from_version=0), InvalidArgumentError),
        (lambda log: log.read(ALICE, to_version=True), InvalidArgumentError),
        (lambda log: log.find_append(ALICE, ""), InvalidArgumentError),
    ],
)
async def test_bad_arguments_are_refused_the_same_way_and_store_nothing(log: EventLog, call: Any, error: type) -> None:
    with pytest.raises(error):
        await call(log)
    assert await log.last_position() == 0


@pytest.mark.parametrize(
    ("options", "error"),
    [({"from_position": 0}, InvalidArgumentError), ({"batch": 0}, InvalidArgumentError),
     ({"categories": ["bad.category"]}, InvalidStreamIdError), ({"categories": "Account"}, InvalidArgumentError)],
)
def test_bad_read_all_arguments_are_refused_at_the_call(log: EventLog, options: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        log.read_all(**options)

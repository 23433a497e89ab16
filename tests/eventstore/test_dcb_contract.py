"""One DCB contract (:class:`DcbLog`), run against the JetStream store on a real nats-server and against the
in-memory store: reads by query in stream order, appends under conditions, idempotency, and every argument's
checks."""

from __future__ import annotations

from typing import Any

import pytest

from eventstore import (
    AppendCondition,
    AppendConditionError,
    DcbLog,
    EventStore,
    EventTooLargeError,
    InMemoryEventStore,
    InvalidArgumentError,
    InvalidEventError,
    Query,
    QueryItem,
    TaggedEvent,
    UncheckableQueryError,
)
from samples.courses import CourseDefined, StudentSubscribed, UsernameClaimed

from .dcb_events import Blob, register


class Stores:
    """A DCB log and the event store under it (for read_all)."""

    def __init__(self, dcb: DcbLog, log: Any) -> None:
        self.dcb = dcb
        self.log = log


@pytest.fixture(params=["jetstream", "memory"])
def stores(request: pytest.FixtureRequest) -> Stores:
    if request.param == "jetstream":
        store: EventStore = request.getfixturevalue("dcb_store")
        return Stores(store.dcb, store)
    memory = InMemoryEventStore()
    register(memory.registry)
    return Stores(memory.dcb, memory)


def course(c: str, capacity: int = 2) -> TaggedEvent:
    return TaggedEvent(CourseDefined(course=c, capacity=capacity), {f"course:{c}"})


def subscribed(s: str, c: str) -> TaggedEvent:
    return TaggedEvent(StudentSubscribed(student=s, course=c), {f"course:{c}", f"student:{s}"})


def _seen(result: Any) -> list[tuple[str, object]]:
    return [(e.type, e.data) for e in result.events]


async def test_read_selects_by_types_and_tags_in_stream_order(stores: Stores) -> None:
    dcb = stores.dcb
    await dcb.append([course("c1"), course("c2")])
    await dcb.append([subscribed("s1", "c1")])
    await dcb.append([subscribed("s1", "c2"), subscribed("s2", "c1")])
    c1 = await dcb.read(Query.of(tags=["course:c1"]))
    assert _seen(c1) == [
        ("CourseDefined", CourseDefined(course="c1", capacity=2)),
        ("StudentSubscribed", StudentSubscribed(student="s1", course="c1")),
        ("StudentSubscribed", StudentSubscribed(student="s2", course="c1")),
    ]
    assert [(e.position, e.index) for e in c1.events] == sorted((e.position, e.index) for e in c1.events)
    assert c1.events[0].tags == frozenset({"course:c1"})
    # Tags AND-ed within an item, types OR-ed, items OR-ed.
    s1_c2 = await dcb.read(Query.of(tags=["course:c2", "student:s1"]))
    assert _seen(s1_c2) == [("StudentSubscribed", StudentSubscribed(student="s1", course="c2"))]
    defined = await dcb.read(Query.of(types=["CourseDefined"]))
    assert [e.data.course for e in defined.events] == ["c1", "c2"]  # type: ignore[attr-defined]
    either = await dcb.read(Query.of(types=["CourseDefined"], tags=["course:c2"]) | Query.of(tags=["student:s2"]))
    assert [e.type for e in either.events] == ["CourseDefined", "StudentSubscribed"]
    assert len((await dcb.read(Query.all())).events) == 5
    assert (await dcb.read(Query.of(tags=["course:c9"]))).events == []


async def test_read_after_and_limit_page_through_the_matches(stores: Stores) -> None:
    dcb = stores.dcb
    for i in range(5):
        await dcb.append([subscribed(f"s{i}", "c1")])
    everything = await dcb.read(Query.of(tags=["course:c1"]))
    first = await dcb.read(Query.of(tags=["course:c1"]), limit=2)
    assert first.events == everything.events[:2] and first.position == everything.events[1].position
    rest = await dcb.read(Query.of(tags=["course:c1"]), after=first.position)
    assert rest.events == everything.events[2:]
    assert everything.position == await stores.log.last_position()


async def test_a_condition_that_holds_lets_the_append_through(stores: Stores) -> None:
    dcb = stores.dcb
    await dcb.append([course("c1")])
    read = await dcb.read(Query.of(tags=["course:c1"]))
    condition = AppendCondition(Query.of(tags=["course:c1"]) | Query.of(tags=["student:s1"]), after=read.position)
    result = await dcb.append([subscribed("s1", "c1")], condition=condition)
    assert (result.first_version, result.last_version, result.duplicate) == (1, 1, False)
    assert len((await dcb.read(Query.of(tags=["course:c1"]))).events) == 2


async def test_a_matching_event_after_the_read_fails_the_append_and_names_its_position(stores: Stores) -> None:
    dcb = stores.dcb
    await dcb.append([course("c1")])
    read = await dcb.read(Query.of(tags=["course:c1"]))
    other = await dcb.append([subscribed("s2", "c1")])  # another writer, after the read
    with pytest.raises(AppendConditionError) as caught:
        await dcb.append([subscribed("s1", "c1")], condition=AppendCondition(Query.of(tags=["course:c1"]), read.position))
    assert (caught.value.after, caught.value.position) == (read.position, other.position)
    students = [e.data.student for e in (await dcb.read(Query.of(types=["StudentSubscribed"]))).events]  # type: ignore[attr-defined]
    assert students == ["s2"]  # nothing of the failed append


async def test_a_condition_from_position_zero_fails_on_any_earlier_match(stores: Stores) -> None:
    dcb = stores.dcb
    first = await dcb.append([TaggedEvent(UsernameClaimed(username="alice", user="u1"), {"username:alice"})])
    claim = AppendCondition(Query.of(tags=["username:alice"]))
    with pytest.raises(AppendConditionError) as caught:
        await dcb.append([TaggedEvent(UsernameClaimed(username="alice", user="u2"), {"username:alice"})], condition=claim)
    assert caught.value.position == first.position
    await dcb.append([TaggedEvent(UsernameClaimed(username="bob", user="u2"), {"username:bob"})],
                     condition=AppendCondition(Query.of(tags=["username:bob"])))


async def test_the_check_is_broader_never_narrower_than_the_query(stores: Stores) -> None:
    dcb = stores.dcb
    read = await dcb.read(Query.of(types=["StudentSubscribed"], tags=["course:c1", "student:s1"]))
    # An event of another type with the checked tag (the item's least tag) is a conflict too: a retry, no more.
    await dcb.append([course("c1")])
    with pytest.raises(AppendConditionError):
        await dcb.append([subscribed("s1", "c1")], condition=AppendCondition(
            Query.of(types=["StudentSubscribed"], tags=["course:c1", "student:s1"]), read.position))
    # An event without the checked tag is none, whatever else it carries.
    again = await dcb.read(Query.of(types=["StudentSubscribed"], tags=["course:c1", "student:s1"]))
    await dcb.append([subscribed("s1", "c2")])
    await dcb.append([subscribed("s1", "c1")], condition=AppendCondition(
        Query.of(types=["StudentSubscribed"], tags=["course:c1", "student:s1"]), again.position))


async def test_a_retry_with_the_key_stores_nothing_twice(stores: Stores) -> None:
    dcb = stores.dcb
    first = await dcb.append([subscribed("s1", "c1")], idempotency_key="cmd-1", note="reply")
    again = await dcb.append([subscribed("s1", "c1")], idempotency_key="cmd-1",
                             condition=AppendCondition(Query.of(tags=["course:c1"])))
    assert (again.position, again.stream_id, again.duplicate, again.note) == (first.position, first.stream_id, True, "reply")
    assert len((await dcb.read(Query.all())).events) == 1
    other = await dcb.append([subscribed("s1", "c1")], idempotency_key="cmd-2")
    assert other.position > first.position and not other.duplicate


async def test_read_all_sees_dcb_events_as_commits_of_their_own(stores: Stores) -> None:
    dcb = stores.dcb
    result = await dcb.append([course("c1"), subscribed("s1", "c1")], condition=AppendCondition(
        Query.of(tags=["course:c1"]) | Query.of(tags=["student:s1"]) | Query.of(tags=["username:x"])))
    events = [e async for batch in stores.log.read_all() for e in batch]
    assert [(e.position, e.stream_id, e.version, e.type) for e in events] == [
        (result.position, result.stream_id, 1, "CourseDefined"), (result.position, result.stream_id, 2, "StudentSubscribed"),
    ]
    assert result.stream_id.category == "Dcb" and events[1].data == StudentSubscribed(student="s1", course="c1")


async def test_a_condition_on_an_untagged_item_is_refused(stores: Stores) -> None:
    with pytest.raises(UncheckableQueryError, match="no tags"):
        AppendCondition(Query.of(types=["CourseDefined"]))
    with pytest.raises(UncheckableQueryError):
        AppendCondition(Query.all())
    assert (await stores.dcb.read(Query.of(types=["CourseDefined"]))).events == []


@pytest.mark.parametrize("tag", [".", "a.b", "*", ">", "%", "%41", "a b", " lead", "ü", "😀", "a,b", "+", "a;b", "_", "x" * 256])
async def test_odd_tags_are_stored_and_matched_exactly(stores: Stores, tag: str) -> None:
    dcb = stores.dcb
    near = {tag + "x", "x" + tag} if len(tag) < 256 else {"y" + tag[1:]}
    await dcb.append([TaggedEvent(Blob(text="near"), near)])
    result = await dcb.append([TaggedEvent(Blob(text=tag), {tag})], condition=AppendCondition(Query.of(tags=[tag])))
    found = await dcb.read(Query.of(tags=[tag]))
    assert [(e.data, e.tags, e.position) for e in found.events] == [(Blob(text=tag), frozenset({tag}), result.position)]


async def test_sizes_at_the_limit(stores: Stores) -> None:
    dcb = stores.dcb
    tags = {f"t{i}" for i in range(32)}
    await dcb.append([TaggedEvent(Blob(text="many"), tags)], condition=AppendCondition(
        Query(tuple(QueryItem(tags=frozenset({t})) for t in tags))))
    assert len((await dcb.read(Query.of(tags=["t31"]))).events) == 1
    with pytest.raises(InvalidArgumentError, match="33 tags"):
        TaggedEvent(Blob(text="x"), {f"t{i}" for i in range(33)})
    with pytest.raises(InvalidArgumentError, match="257 characters, at most 256"):
        TaggedEvent(Blob(text="x"), {"x" * 257})
    with pytest.raises(EventTooLargeError):
        await dcb.append([TaggedEvent(Blob(text="x" * (1024 * 1024)), {"big"})])
    with pytest.raises(InvalidEventError, match="1000"):
        await dcb.append([TaggedEvent(Blob(text="x"), {f"e{i}-{j}" for j in range(32)}) for i in range(32)])
    assert [e.data.text for e in (await dcb.read(Query.all())).events] == ["many"]  # type: ignore[attr-defined]


BAD_APPENDS: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"events": "CourseDefined"}, InvalidArgumentError),
    ({"events": TaggedEvent(Blob(text="x"))}, InvalidArgumentError),
    ({"events": [Blob(text="x")]}, InvalidArgumentError),
    ({"events": []}, InvalidEventError),
    ({"condition": Query.of(tags=["a"])}, InvalidArgumentError),
    ({"idempotency_key": ""}, InvalidArgumentError),
    ({"idempotency_key": 5}, InvalidArgumentError),
    ({"correlation_id": "a\nb"}, InvalidArgumentError),
    ({"causation_id": " x"}, InvalidArgumentError),
    ({"note": "x" * 4097}, InvalidArgumentError),
]


@pytest.mark.parametrize(("arguments", "error"), BAD_APPENDS)
async def test_bad_append_arguments_are_refused_before_anything_is_stored(
    stores: Stores, arguments: dict[str, Any], error: type[Exception]
) -> None:
    call: dict[str, Any] = {"events": [course("c1")], **arguments}
    with pytest.raises(error):
        await stores.dcb.append(**call)
    assert await stores.log.last_position() == 0


@pytest.mark.parametrize(("arguments", "error"), [
    ({"query": "course:c1"}, InvalidArgumentError),
    ({"after": -1}, InvalidArgumentError),
    ({"after": True}, InvalidArgumentError),
    ({"after": "1"}, InvalidArgumentError),
    ({"limit": 0}, InvalidArgumentError),
    ({"limit": 2.0}, InvalidArgumentError),
])
async def test_bad_read_arguments_are_refused(stores: Stores, arguments: dict[str, Any], error: type[Exception]) -> None:
    call: dict[str, Any] = {"query": Query.all(), **arguments}
    with pytest.raises(error):
        await stores.dcb.read(**call)


@pytest.mark.parametrize(("build", "match"), [
    (lambda: TaggedEvent(Blob(text="x"), "course:c1"), "not one string"),
    (lambda: TaggedEvent(Blob(text="x"), {5}), "non-empty str"),
    (lambda: TaggedEvent(Blob(text="x"), {""}), "non-empty str"),
    (lambda: TaggedEvent(Blob(text="x"), {"a\nb"}), "control"),
    (lambda: TaggedEvent(Blob(text="x"), {"\ud800"}), "surrogate"),
    (lambda: TaggedEvent({"text": "x"}, {"a"}), "pydantic"),  # type: ignore[arg-type]
    (lambda: QueryItem(types="CourseDefined"), "not one string"),  # type: ignore[arg-type]
    (lambda: Query(()), "one or more"),
    (lambda: Query(["a"]), "one or more"),  # type: ignore[list-item]
    (lambda: AppendCondition("q"), "Query"),  # type: ignore[arg-type]
    (lambda: AppendCondition(Query.of(tags=["a"]), after=-1), "int >= 0"),
    (lambda: AppendCondition(Query.of(tags=["a"]), after=None), "int >= 0"),  # type: ignore[arg-type]
])
def test_bad_values_are_refused_on_construction(build: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        build()


async def test_a_condition_after_an_appends_own_position_counts_the_append_as_read(stores: Stores) -> None:
    dcb = stores.dcb
    query = Query.of(tags=["course:c1"]) | Query.of(tags=["student:s1"])
    first = await dcb.append([subscribed("s1", "c1")])
    with pytest.raises(AppendConditionError) as caught:
        await dcb.append([subscribed("s1", "c2")], condition=AppendCondition(query, first.position - 1))
    assert caught.value.position == first.position
    second = await dcb.append([subscribed("s1", "c2")], condition=AppendCondition(query, first.position))
    await dcb.append([subscribed("s1", "c3")], condition=AppendCondition(query, second.position))


async def test_find_append_tells_what_a_key_stored(stores: Stores) -> None:
    dcb = stores.dcb
    stored = await dcb.append([course("c1")], idempotency_key="define-c1", note="made")
    found = await dcb.find_append("define-c1")
    assert found is not None and (found.position, found.count, found.duplicate, found.note) == (
        stored.position, 1, True, "made")
    assert await dcb.find_append("define-c2") is None
    for bad in ("", 5, None):
        with pytest.raises(InvalidArgumentError):
            await dcb.find_append(bad)  # type: ignore[arg-type]

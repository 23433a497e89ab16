"""Decision models (:class:`Decisions`) with the course and username rules of ``samples/courses.py``: the rules on
both stores, reruns by command id, retries after a broken condition, interleaved writers against a model
(hypothesis), and many writers on the real server."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from aggregates import Decisions, DomainError, Fold, RetryPolicy
from eventstore import (
    AppendConditionError,
    EventStore,
    EventStoreSettings,
    InMemoryEventStore,
    InvalidArgumentError,
    Query,
    TaggedEvent,
)
from samples.courses import MAX_COURSES, Courses, CourseDefined, StudentSubscribed, UsernameClaimed, UsernameReleased, register


@pytest.fixture
async def dcb_store(store: EventStore) -> EventStore:
    register(store.registry)
    await store.dcb.ensure_index()
    return store


@pytest.fixture(params=["jetstream", "memory"])
def courses(request: pytest.FixtureRequest) -> Courses:
    if request.param == "jetstream":
        return Courses(Decisions(request.getfixturevalue("dcb_store")))
    memory = InMemoryEventStore()
    register(memory.registry)
    return Courses(Decisions(memory))


async def test_a_course_takes_as_many_students_as_it_has_places(courses: Courses) -> None:
    await courses.define_course("c1", 2)
    with pytest.raises(DomainError, match="exists"):
        await courses.define_course("c1", 5)
    await courses.subscribe("s1", "c1")
    with pytest.raises(DomainError, match="already"):
        await courses.subscribe("s1", "c1")
    await courses.subscribe("s2", "c1")
    with pytest.raises(DomainError, match="full"):
        await courses.subscribe("s3", "c1")
    with pytest.raises(DomainError, match="no course"):
        await courses.subscribe("s3", "c9")


async def test_a_student_takes_at_most_the_course_limit(courses: Courses) -> None:
    for c in range(MAX_COURSES + 1):
        await courses.define_course(f"c{c}", 10)
    for c in range(MAX_COURSES):
        await courses.subscribe("s1", f"c{c}")
    with pytest.raises(DomainError, match=f"{MAX_COURSES} courses"):
        await courses.subscribe("s1", f"c{MAX_COURSES}")
    await courses.subscribe("s2", f"c{MAX_COURSES}")


async def test_usernames_are_unique_and_change_in_one_step(courses: Courses) -> None:
    await courses.claim_username("alice", "u1")
    with pytest.raises(DomainError, match="taken"):
        await courses.claim_username("alice", "u2")
    with pytest.raises(DomainError, match="does not own"):
        await courses.change_username("alice", "bob", "u2")
    changed = await courses.change_username("alice", "alicia", "u1")
    assert changed.count == 2
    await courses.claim_username("alice", "u2")  # released by the change
    with pytest.raises(DomainError, match="taken"):
        await courses.claim_username("alicia", "u3")


async def test_a_rerun_of_a_command_id_stores_nothing_even_when_its_rules_would_now_refuse(courses: Courses) -> None:
    await courses.define_course("c1", 1)
    first = await courses.subscribe("s1", "c1", command_id="sub-1")
    again = await courses.subscribe("s1", "c1", command_id="sub-1")  # decide refuses now ("already"): still a rerun
    assert (again.position, again.count, again.duplicate, first.duplicate) == (first.position, 1, True, False)
    with pytest.raises(DomainError, match="full"):
        await courses.subscribe("s2", "c1", command_id="sub-2")


async def test_a_condition_broken_while_deciding_reruns_the_command_on_the_new_events(courses: Courses) -> None:
    decisions = courses.decisions
    await courses.define_course("c1", 1)
    seen: list[int] = []

    async def decide(state: dict[str, Any]) -> list[TaggedEvent]:
        seen.append(state["taken"])
        if len(seen) == 1:  # another writer takes the last place between this read and this append
            await courses.subscribe("s2", "c1")
        if state["taken"] >= 1:
            raise DomainError("full")
        return [TaggedEvent(StudentSubscribed(student="s1", course="c1"), {"course:c1", "student:s1"})]

    taken = Fold(Query.of(types=["StudentSubscribed"], tags=["course:c1"]), 0, lambda n, _: n + 1)
    with pytest.raises(DomainError, match="full"):
        await decisions.execute({"taken": taken}, decide)
    assert seen == [0, 1]


async def test_a_command_gives_up_after_the_retry_attempts(courses: Courses) -> None:
    decisions = Decisions(courses.decisions.store, retry=RetryPolicy(attempts=2, base_delay_s=0.0))
    runs = itertools.count()

    async def decide(state: dict[str, Any]) -> list[TaggedEvent]:
        await courses.claim_username(f"other{next(runs)}", "x")  # every run loses to another writer
        return [TaggedEvent(UsernameClaimed(username="other-x", user="y"), {"username:other-x"})]

    fold = Fold(Query.of(types=["UsernameClaimed"], tags=["username:other0"]) | Query.of(tags=["username:other1"]), 0,
                lambda n, _: n + 1)
    with pytest.raises(AppendConditionError):
        await decisions.execute({"n": fold}, decide)
    assert next(runs) == 2


class CountingLog:
    """An in-memory store that counts the reads of its DCB log."""

    def __init__(self) -> None:
        self.memory = InMemoryEventStore()
        self.reads = 0
        self.dcb = self

    async def read(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        return await self.memory.dcb.read(*args, **kwargs)


ANY_FOLD = {"a": Fold(Query.all(), 0, lambda n, _: n)}


@pytest.mark.parametrize(("folds", "decide", "options"), [
    ({}, lambda s: [], {}),
    ([Fold(Query.all(), 0, lambda n, _: n)], lambda s: [], {}),
    ({"a": Query.all()}, lambda s: [], {}),
    (ANY_FOLD, "decide", {}),
    (ANY_FOLD, lambda s: [], {"command_id": ""}),
    (ANY_FOLD, lambda s: [], {"command_id": 7}),
    (ANY_FOLD, lambda s: [], {"correlation_id": "a\nb"}),
    (ANY_FOLD, lambda s: [], {"causation_id": " x"}),
])
async def test_bad_arguments_are_refused_before_anything_is_read(folds: Any, decide: Any, options: Any) -> None:
    store = CountingLog()
    with pytest.raises(InvalidArgumentError):
        await Decisions(store).execute(folds, decide, **options)  # type: ignore[arg-type]
    assert store.reads == 0


def test_a_decision_model_checks_its_store_and_retry_policy() -> None:
    with pytest.raises(InvalidArgumentError, match="store"):
        Decisions(object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="RetryPolicy"):
        Decisions(InMemoryEventStore(), retry=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("returned", [None, TaggedEvent(UsernameClaimed(username="a", user="u")), "events", [5]])
async def test_a_decision_returning_no_list_of_tagged_events_stores_nothing(returned: Any) -> None:
    memory = InMemoryEventStore()
    register(memory.registry)
    fold = Fold(Query.of(tags=["username:a"]), 0, lambda n, _: n + 1)
    with pytest.raises(InvalidArgumentError):
        await Decisions(memory).execute({"n": fold}, lambda state: returned)
    assert await memory.last_position() == 0


def test_a_fold_checks_its_parts() -> None:
    with pytest.raises(InvalidArgumentError, match="Query"):
        Fold("course:c1", 0, lambda n, _: n)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="function"):
        Fold(Query.all(), 0, 5)  # type: ignore[arg-type]


# -- invariants under interleaved writers -----------------------------------------------------------------------


class Yielding:
    """A DCB log that lets other tasks run before each read and append (as the network does), as ``pauses`` say."""

    def __init__(self, inner: Any, pauses: list[int]) -> None:
        self.inner = inner
        self.pauses = itertools.cycle(pauses or [0])

    async def _pause(self) -> None:
        for _ in range(next(self.pauses)):
            await asyncio.sleep(0)

    async def read(self, *args: Any, **kwargs: Any) -> Any:
        await self._pause()
        return await self.inner.read(*args, **kwargs)

    async def append(self, *args: Any, **kwargs: Any) -> Any:
        await self._pause()
        return await self.inner.append(*args, **kwargs)

    async def find_append(self, *args: Any, **kwargs: Any) -> Any:
        return await self.inner.find_append(*args, **kwargs)


class YieldingStore:
    def __init__(self, dcb: Yielding) -> None:
        self.dcb = dcb


COMMAND = st.one_of(
    st.tuples(st.just("subscribe"), st.sampled_from(["s1", "s2", "s3", "s4"]), st.sampled_from(["c1", "c2", "c3", "c4"])),
    st.tuples(st.just("claim"), st.sampled_from(["alice", "bob"]), st.sampled_from(["u1", "u2", "u3"])),
    st.tuples(st.just("change"), st.sampled_from(["alice", "bob"]), st.sampled_from(["alice", "bob"]), st.sampled_from(["u1", "u2"])),
)


def check_invariants(events: list[Any], capacities: dict[str, int]) -> None:
    """The rules hold over the stored events, replayed in order (a model of the domain, independent of it)."""
    per_course: Counter[str] = Counter()
    per_student: Counter[str] = Counter()
    pairs: set[tuple[str, str]] = set()
    owners: dict[str, str | None] = {}
    for data in events:
        if isinstance(data, StudentSubscribed):
            assert data.course in capacities
            assert (data.student, data.course) not in pairs
            pairs.add((data.student, data.course))
            per_course[data.course] += 1
            per_student[data.student] += 1
            assert per_course[data.course] <= capacities[data.course]
            assert per_student[data.student] <= MAX_COURSES
        elif isinstance(data, UsernameClaimed):
            assert owners.get(data.username) is None, f"{data.username} claimed twice"
            owners[data.username] = data.user
        elif isinstance(data, UsernameReleased):
            assert owners.get(data.username) == data.user
            owners[data.username] = None


async def run_commands(courses: Courses, commands: list[tuple[str, ...]]) -> None:
    async def one(command: tuple[str, ...]) -> None:
        try:
            if command[0] == "subscribe":
                await courses.subscribe(command[1], command[2])
            elif command[0] == "claim":
                await courses.claim_username(command[1], command[2])
            else:
                await courses.change_username(command[1], command[2], command[3])
        except DomainError:
            pass

    await asyncio.gather(*(one(c) for c in commands))


CAPACITIES = {"c1": 1, "c2": 2, "c3": 3}  # c4 is never defined


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(COMMAND, min_size=1, max_size=24), st.lists(st.integers(0, 4), max_size=8))
def test_interleaved_writers_never_break_a_rule(commands: list[tuple[str, ...]], pauses: list[int]) -> None:
    async def scenario() -> list[Any]:
        memory = InMemoryEventStore()
        register(memory.registry)
        for course, capacity in CAPACITIES.items():
            await Courses(Decisions(memory)).define_course(course, capacity)
        courses = Courses(Decisions(YieldingStore(Yielding(memory.dcb, pauses)), retry=RetryPolicy(base_delay_s=0.0)))  # type: ignore[arg-type]
        await run_commands(courses, commands)
        return [e.data for batch in [b async for b in memory.read_all()] for e in batch]

    events = asyncio.run(scenario())
    check_invariants(events, CAPACITIES)


def test_the_invariant_check_catches_a_broken_rule() -> None:
    with pytest.raises(AssertionError):
        check_invariants([StudentSubscribed(student="s1", course="c1")] * 2, {"c1": 5})
    with pytest.raises(AssertionError):
        check_invariants([StudentSubscribed(student=f"s{i}", course="c1") for i in range(2)], {"c1": 1})
    with pytest.raises(AssertionError):
        check_invariants([UsernameClaimed(username="a", user="u1"), UsernameClaimed(username="a", user="u2")], {})


async def test_many_writers_on_the_server_never_break_a_rule(dcb_store: EventStore, settings: EventStoreSettings) -> None:
    await Courses(Decisions(dcb_store)).define_course("c1", 3)
    await Courses(Decisions(dcb_store)).define_course("c2", 5)
    writers = [await EventStore.connect(settings) for _ in range(4)]
    try:
        for writer in writers:
            register(writer.registry)
        commands: list[tuple[str, ...]] = [("subscribe", f"s{i % 8}", f"c{1 + i % 2}") for i in range(32)]
        commands += [("claim", "alice", f"u{i}") for i in range(8)] + [("change", "alice", "bob", f"u{i}") for i in range(8)]
        await asyncio.gather(*(
            run_commands(Courses(Decisions(w, retry=RetryPolicy(attempts=200))), commands[i::len(writers)])
            for i, w in enumerate(writers)
        ))
    finally:
        for writer in writers:
            await writer.close()
    events = [e.data async for batch in dcb_store.read_all() for e in batch]
    check_invariants(events, {"c1": 3, "c2": 5})
    subscriptions = Counter(e.course for e in events if isinstance(e, StudentSubscribed))
    assert subscriptions == {"c1": 3, "c2": 4}  # c1 full, each of c2's four students in: retried until decided
    assert sum(isinstance(e, UsernameClaimed) for e in events) >= 1
    assert sum(isinstance(e, CourseDefined) for e in events) == 2

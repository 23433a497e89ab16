"""Reactors over a stream holding DCB appends (the course rules of ``samples/courses.py``): every DCB event is
handed to the reactor once, no index message ever is, and a reactor's DCB commands store their effect once."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import pytest
from pydantic import BaseModel

from aggregates import Decisions
from eventstore import AppendCondition, EventStore, Query, RecordedEvent, StreamId, TaggedEvent
from projections import Reactor, read_reactor_dead_letters, run_reactor
from samples.courses import Courses, StudentSubscribed, register


class Invoiced(BaseModel):
    amount: int


class WelcomeSent(BaseModel):
    student: str
    course: str


@pytest.fixture
async def courses_store(store: EventStore) -> EventStore:
    register(store.registry)
    store.registry.register(Invoiced)
    store.registry.register(WelcomeSent)
    await store.dcb.ensure_index()
    return store


async def stored_events(store: EventStore, categories: Sequence[str] | None) -> list[RecordedEvent]:
    return [e async for batch in store.read_all(categories=categories) for e in batch]


@pytest.mark.parametrize("categories", [None, ("Dcb",)], ids=["every-category", "dcb-category"])
async def test_a_reactor_gets_every_dcb_event_once_and_never_an_index_message(
    courses_store: EventStore, categories: tuple[str, ...] | None
) -> None:
    store = courses_store
    courses = Courses(Decisions(store))
    await store.append(StreamId("Invoice", "i1"), [Invoiced(amount=1)])
    for course in ("c1", "c2"):
        await courses.define_course(course, 10)  # each checks its own tag on its index message
    for student in ("s1", "s2", "s3"):
        await courses.subscribe(student, "c1")  # two tags written and checked
        await store.append(StreamId("Invoice", "i1"), [Invoiced(amount=2)])
    await courses.claim_username("ann", "u1")
    await courses.change_username("ann", "anne", "u1")  # two events in one commit
    # A condition on a tag the append does not write travels on an empty carrier message of the index.
    await store.dcb.append([TaggedEvent(WelcomeSent(student="s1", course="c1"))],
                           condition=AppendCondition(Query.of(tags=["course:c9"])))
    expected = await stored_events(store, categories)
    assert {e.stream_id.category for e in expected} == ({"Dcb"} if categories else {"Dcb", "Invoice"})
    assert await store.last_position() > len({e.position for e in expected}) + 10, "index messages lie in between"

    handled: Counter[tuple[int, int]] = Counter()

    async def record(event: RecordedEvent) -> None:
        handled[(event.position, event.index)] += 1

    reactor = Reactor("dcb-watcher", handler=record, categories=categories, ack_wait_s=5)
    async with asyncio.timeout(30):
        stats = await run_reactor(store, reactor, until_idle=True)

    assert handled == Counter((e.position, e.index) for e in expected), "every event once, nothing else"
    assert (stats.handled, stats.skipped, stats.retried, stats.dead_lettered) == (len(expected), 0, 0, 0)
    assert await read_reactor_dead_letters(store, "dcb-watcher") == []


async def test_a_reactor_that_reacts_with_dcb_appends_stores_each_effect_once_across_a_redelivery(
    courses_store: EventStore,
) -> None:
    store = courses_store
    courses = Courses(Decisions(store))
    await courses.define_course("c1", 10)
    for student in ("s1", "s2", "s3"):
        await courses.subscribe(student, "c1")
    calls: Counter[str] = Counter()

    async def welcome(event: RecordedEvent) -> None:
        data = event.data
        assert isinstance(data, StudentSubscribed)
        calls[data.student] += 1
        await store.dcb.append([TaggedEvent(WelcomeSent(student=data.student, course=data.course),
                                            {f"student:{data.student}"})],
                               idempotency_key=reactor.idempotency_key(event))
        if data.student == "s2" and calls["s2"] == 1:
            raise ConnectionError("the acknowledgement is lost after the effect")

    reactor = Reactor("welcomer", handlers={StudentSubscribed: welcome}, categories=["Dcb"],
                      retry_backoff_s=[0.05], ack_wait_s=5)
    async with asyncio.timeout(30):
        stats = await run_reactor(store, reactor, until_idle=True)

    assert calls == {"s1": 1, "s2": 2, "s3": 1}
    sent = (await store.dcb.read(Query.of(types=["WelcomeSent"]))).events
    assert sorted(e.data.student for e in sent) == ["s1", "s2", "s3"]  # type: ignore[attr-defined]
    # Handled: the acknowledged ones. Skipped (no handler): the course's definition and the reactor's own events.
    assert (stats.handled, stats.skipped, stats.retried, stats.dead_lettered) == (3, 4, 1, 0)

"""Decision models: commands decided on the events of queries, appended under the condition of what was read.

A :class:`Fold` turns the events of one :class:`~eventstore.Query` into one piece of state (a course's capacity,
a student's number of courses). :meth:`Decisions.execute` reads the events of all of a command's folds at once,
folds them, hands the states to the command's ``decide`` function, and appends what it returns under the
condition "no event any fold queries was stored after what I read" (checked by the server in the same commit: see
docs/concepts/dcb.md). When another writer got there first the condition fails, and the command is read, folded
and decided again, as :meth:`Repository.execute <aggregates.Repository.execute>` does on a conflict.

Example (the course-subscription rules of dcb.events; ``samples/courses.py`` has the whole of it)::

    capacity = Fold(Query.of(types=["CourseDefined"], tags=[f"course:{c}"]), 0, lambda n, e: e.data.capacity)
    taken = Fold(Query.of(types=["StudentSubscribed"], tags=[f"course:{c}"]), 0, lambda n, e: n + 1)

    def decide(state: dict[str, Any]) -> list[TaggedEvent]:
        if state["taken"] >= state["capacity"]:
            raise DomainError("The course is full.")
        return [TaggedEvent(StudentSubscribed(student=s, course=c), {f"course:{c}", f"student:{s}"})]

    await Decisions(store).execute({"capacity": capacity, "taken": taken}, decide, command_id=request_id)
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from eventstore import (
    AppendCondition,
    AppendConditionError,
    DcbLog,
    InvalidArgumentError,
    Query,
    SequencedEvent,
    TaggedEvent,
)

from eventstore.wire import check_idempotency_key, check_metadata

from .commands import RetryPolicy

__all__ = ["DecisionResult", "Decisions", "Fold"]

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Fold(Generic[S]):
    """One piece of a decision's state: the events ``query`` matches, in stream order, folded by ``apply``
    from ``initial`` (``apply(state, event)`` returns the next state; it must not change ``initial`` in place)."""

    query: Query
    initial: S
    apply: Callable[[S, SequencedEvent], S]

    def __post_init__(self) -> None:
        if not isinstance(self.query, Query):
            raise InvalidArgumentError(f"Invalid fold query {self.query!r:.80}; give an eventstore.Query.")
        if not callable(self.apply):
            raise InvalidArgumentError(f"Invalid fold apply {self.apply!r:.80}; give a function (state, event) -> state.")


@dataclass(frozen=True, slots=True)
class DecisionResult:
    """What a command stored: the commit's ``position`` and its number of events (``count``; 0 when the decision
    appended nothing, and ``position`` is then the position it read up to); ``duplicate`` when the command id had
    been stored by an earlier run (nothing new was stored; ``position`` and ``count`` are that run's); how many
    times it was decided (``attempts``: one more per condition another writer broke)."""

    position: int
    count: int
    duplicate: bool = False
    attempts: int = 1


class _HasDcb(Protocol):
    @property
    def dcb(self) -> DcbLog: ...


class Decisions:
    """Runs commands decided on folded queries against a store's DCB log (``store.dcb``), with retries.

    ``store`` is an :class:`~eventstore.EventStore` (its stream prepared by ``await store.dcb.ensure_index()``) or
    an :class:`~eventstore.InMemoryEventStore`; ``retry`` bounds the attempts after broken conditions.
    """

    def __init__(self, store: _HasDcb, *, retry: RetryPolicy | None = None) -> None:
        if not hasattr(store, "dcb"):
            raise InvalidArgumentError(
                f"Invalid store {store!r:.80}: give an EventStore or an InMemoryEventStore (it has .dcb)."
            )
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise InvalidArgumentError(f"Invalid retry {retry!r:.80}: give a RetryPolicy or None.")
        self.store = store
        self.retry = retry or RetryPolicy()

    async def execute(
        self,
        folds: Mapping[str, Fold[Any]],
        decide: Callable[[dict[str, Any]], Sequence[TaggedEvent] | Awaitable[Sequence[TaggedEvent]]],
        *,
        command_id: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> DecisionResult:
        """Read the folds' events, fold them, ``decide`` on the states (a dict by fold name), and append the
        events it returns under the combined condition; decide again when another writer broke it.

        * The condition covers every fold's query from the position the read reached: no event appended in
          between that a fold would have seen passes unnoticed (see docs/concepts/dcb.md for how the server
          checks it). A broken condition reruns the whole command after a jittered pause, at most
          ``retry.attempts`` appends; then the last :class:`~eventstore.AppendConditionError` is raised.
        * An exception from ``decide`` (e.g. a :class:`DomainError`) stores nothing and is raised, never retried;
          an empty list stores nothing.
        * ``command_id`` makes the command idempotent at any age: it is the append's idempotency key, so a rerun
          stores nothing and returns the first run's result with ``duplicate=True`` (also when the first run's
          own events would now make ``decide`` refuse).
        """
        if not isinstance(folds, Mapping) or not folds or not all(isinstance(f, Fold) for f in folds.values()):
            raise InvalidArgumentError(f"Invalid folds {folds!r:.80}; give a dict of name -> Fold, at least one.")
        if not callable(decide):
            raise InvalidArgumentError(f"Invalid decide {decide!r:.80}; give a function of the states' dict.")
        check_idempotency_key(command_id)  # before anything is read, as every store's checks
        check_metadata("correlation_id", correlation_id)
        check_metadata("causation_id", causation_id)
        query = Query(tuple(item for fold in folds.values() for item in fold.query.items))
        dcb = self.store.dcb
        attempts = 0
        while True:
            attempts += 1
            read = await dcb.read(query)
            states = {name: fold.initial for name, fold in folds.items()}
            for event in read.events:
                for name, fold in folds.items():
                    if fold.query.matches(event.type, event.tags):
                        states[name] = fold.apply(states[name], event)
            try:
                outcome = decide(states)
                returned = await outcome if inspect.isawaitable(outcome) else outcome
            except Exception:
                if command_id is not None and (stored := await self._stored(command_id)) is not None:
                    return stored
                raise
            if isinstance(returned, (str, bytes, TaggedEvent)) or not isinstance(returned, Sequence):
                raise InvalidArgumentError(
                    f"decide returned {returned!r:.80}; it must return a list of TaggedEvent (empty: nothing to store). "
                    "Nothing was stored."
                )
            events = list(returned)
            if not events:
                stored = await self._stored(command_id) if command_id is not None else None
                return stored or DecisionResult(read.position, 0, attempts=attempts)
            try:
                result = await dcb.append(
                    events, condition=AppendCondition(query, read.position), idempotency_key=command_id,
                    correlation_id=correlation_id, causation_id=causation_id,
                )
            except AppendConditionError:
                if attempts >= self.retry.attempts:
                    raise
                await asyncio.sleep(self.retry.delay_s(attempts - 1))
                continue
            return DecisionResult(result.position, result.count, result.duplicate, attempts)

    async def _stored(self, command_id: str) -> DecisionResult | None:
        """The first run's result when ``command_id`` was stored (a rerun that ``decide`` now refuses)."""
        found = await self.store.dcb.find_append(command_id)
        return None if found is None else DecisionResult(found.position, found.count, True)

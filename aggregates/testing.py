"""Given/when/then tests of an aggregate's commands, against a real event store or an in-memory one::

    await scenario(store, Dog).given(Registered(name="Fido")).when(lambda dog: dog.add_trick("roll")).then(
        TrickAdded(trick="roll")
    )
    await scenario(school, Account).given(Opened(owner="Ann")).when(lambda a: a.withdraw(5)).then(InsufficientFunds)

``given`` stores events on a fresh aggregate (a new id each scenario),
``when`` runs one command through the repository, and ``then`` checks what it
recorded: exactly these events (compared as models), or this error (and
nothing stored). A failed check raises ``AssertionError`` saying what differs,
so the helpers work with pytest and with any other runner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from eventstore import NO_STREAM, EventLog, InvalidArgumentError

from .aggregate import Aggregate
from .application import Application, new_id
from .repository import Repository

__all__ = ["Scenario", "scenario"]

A = TypeVar("A", bound=Aggregate[Any])


def scenario(store: EventLog | Application, aggregate_type: type[A]) -> Scenario[A]:
    """A scenario for ``aggregate_type`` on ``store`` (an :class:`~eventstore.EventStore`, an
    :class:`~eventstore.InMemoryEventStore`, or an application's store)."""
    if isinstance(store, Application):
        return Scenario(store.repository(aggregate_type))
    return Scenario(Repository(store, aggregate_type, cache_size=0))


class Scenario(Generic[A]):
    """One given/when/then test; each step returns the scenario, ``then`` is awaited."""

    def __init__(self, repository: Repository[A]) -> None:
        self.repository = repository
        self.aggregate_id = new_id()
        self._given: list[BaseModel] = []
        self._when: Callable[[A], Any] | None = None

    def given(self, *events: BaseModel) -> Scenario[A]:
        """The aggregate's history before the command (none: the command creates it)."""
        bad = [e for e in events if not isinstance(e, BaseModel)]
        if bad:
            raise InvalidArgumentError(f"given() takes event instances, not {bad[0]!r:.80}.")
        self._given = list(events)
        return self

    def when(self, command: Callable[[A], Any]) -> Scenario[A]:
        """The command, run on the aggregate as :meth:`Repository.execute` runs it."""
        if not callable(command):
            raise InvalidArgumentError(f"when() takes a function of the aggregate, not {command!r:.80}.")
        self._when = command
        return self

    async def then(self, *expected: BaseModel | type[BaseException]) -> list[BaseModel]:
        """Check that the command recorded exactly ``expected`` events (returned), or raised the one exception
        class given (and stored nothing)."""
        __tracebackhide__ = True  # pytest reports a failed check at the test's line, not in here
        return await self._run(expected)

    async def _run(self, expected: tuple[BaseModel | type[BaseException], ...]) -> list[BaseModel]:
        __tracebackhide__ = True
        if self._when is None:
            raise InvalidArgumentError("A scenario needs when(command) before then(...).")
        store, stream_id = self.repository.store, self.repository.aggregate_type._stream_id(self.aggregate_id)
        if self._given:
            await store.append(stream_id, self._given, NO_STREAM)
        errors = [e for e in expected if isinstance(e, type) and issubclass(e, BaseException)]
        if errors and len(expected) != 1:
            raise InvalidArgumentError("then() takes either the events expected or one exception class, not both.")
        before = len(self._given)
        try:
            await self.repository.execute(self.aggregate_id, self._when, create=not self._given)
        except Exception as exc:
            if not errors:
                raise AssertionError(f"The command raised {type(exc).__name__}: {exc}; expected events {list(expected)}.") from exc
            if not isinstance(exc, errors[0]):
                raise AssertionError(f"The command raised {type(exc).__name__}: {exc}; expected {errors[0].__name__}.") from exc
            stored = await store.read(stream_id)
            if len(stored) != before:
                raise AssertionError(f"The command raised {type(exc).__name__} but stored {len(stored) - before} event(s).") from exc
            return []
        recorded = [e.data for e in (await store.read(stream_id))[before:]]
        if errors:
            raise AssertionError(f"The command recorded {recorded} instead of raising {errors[0].__name__}.")
        if recorded != list(expected):
            raise AssertionError(f"The command recorded {recorded}; expected {list(expected)}.")
        return recorded


"""Retrying a reactor's dead letters: its handlers run again on each dead-lettered commit, here and now.

``jetsourcing dead-letters retry module:reactor --position P`` (or ``--all``)
loads the reactor, reads its dead letters (oldest first), and runs each
commit's events through the reactor's handlers in this process, as a worker
would. A commit whose handlers all succeed leaves the dead-letter stream; one
whose handler raises again stays, with the new error reported. Delivery stays
at-least-once: a retried side effect whose dead letter could not be deleted
afterwards runs again on the next retry, so handlers keep using
``reactor.idempotency_key(event)``. An undecodable commit is never retried
(nothing can handle it): drop it once dealt with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from eventstore import EventStore, UnknownEventTypeError

from .dead_letters import delete_dead_letter, read_reactor_dead_letters
from .worker import Reactor

__all__ = ["RetryResult", "retry_reactor_dead_letters"]


@dataclass(frozen=True, slots=True)
class RetryResult:
    """What a retry did: the positions whose handlers now succeeded (their dead letters deleted), and the ones
    that failed again, with the error."""

    retried: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)


async def retry_reactor_dead_letters(store: EventStore, reactor: Reactor, position: int | None) -> RetryResult:
    """Run ``reactor``'s handlers again on its dead letters of the commit at ``position`` (every one when None);
    delete each dead letter whose commit they now handle. See the module docs."""
    for key in reactor.handlers:
        if isinstance(key, type) and issubclass(key, BaseModel):
            try:
                store.registry.name_of(key)
            except UnknownEventTypeError:
                store.registry.register(key)  # a fresh process: the reactor's classes decode its events
    handlers = reactor.handlers_by_type(store.registry)
    result = RetryResult()
    for letter in await read_reactor_dead_letters(store, reactor.name):
        if position is not None and letter.position != position:
            continue
        if not letter.events:
            result.failed.append((letter.position, "the commit cannot be decoded into events; drop it once handled"))
            continue
        try:
            await reactor.handle(letter.events, handlers)
        except Exception as exc:  # noqa: BLE001 - reported per commit; the dead letter stays
            result.failed.append((letter.position, f"{type(exc).__name__}: {exc}"))
            continue
        await delete_dead_letter(store, letter)
        result.retried.append(letter.position)
    return result

"""``jetsourcing dead-letters``: every dead letter of the projections and the reactors; retrying and dropping them.

A projection's dead letters (``error_policy="dead_letter"``) live in its
read-model store with the generation they belong to; a reactor's live in the
dead-letter stream. ``list`` shows both; ``drop`` forgets the ones you have
dealt with by hand, and changes nothing else (no read model, checkpoint or
consumer moves); ``retry`` runs a reactor's handlers again on its dead letters
(:mod:`projections.reactors.retry`). A projection's dead-lettered commit is not
retried on its own: the commits after it were applied without it, so applying
it now would apply it out of order. Its retry is a rebuild, which applies
every commit in order with the fixed handler (see :data:`PROJECTION_RETRY`).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Literal

from eventstore import EventStoreError, ImportPathError, import_object

from .backends import open_store
from .connection import connect_event_store
from .errors import ProjectionError, ReadModelNotFoundError
from .reactors.dead_letters import drop_reactor_dead_letters, read_reactor_dead_letters
from .reactors.retry import RetryResult, retry_reactor_dead_letters
from .reactors.worker import Reactor
from .settings import ProjectionSettings
from .text import aligned

__all__ = [
    "PROJECTION_RETRY",
    "DeadLetterEntry",
    "drop_dead_letters",
    "format_dead_letters",
    "read_dead_letters",
    "retry_dead_letters",
]

PROJECTION_RETRY = (
    "A projection's dead-lettered commit is not retried on its own: the commits after it were applied without it, "
    "so applying it now would apply it out of order. Fix the handler, then rebuild the projection (jetsourcing "
    "rebuild module:Projection, or bump its version for the daemon to rebuild): the rebuild applies every commit "
    "in order, and its dead letters are the ones the fixed code still fails on."
)
"""Why ``dead-letters retry --projection`` refuses, and what to do instead."""


@dataclass(frozen=True, slots=True)
class DeadLetterEntry:
    """One dead letter, of a projection or of a reactor."""

    kind: Literal["projection", "reactor"]
    name: str
    position: int
    """The stream position of the commit given up on."""
    stream: str
    event_type: str
    error: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (``jetsourcing dead-letters list --json``)."""
        return asdict(self)


async def read_dead_letters(settings: ProjectionSettings) -> tuple[list[DeadLetterEntry], str | None]:
    """Every dead letter: the projections' (when there are read models) and the reactors' (when the server can
    be asked), and a note saying what could not be read (None when everything was). Creates nothing."""
    entries: list[DeadLetterEntry] = []
    missing: list[str] = []
    try:
        entries += await asyncio.to_thread(_projection_dead_letters, settings)
    except ReadModelNotFoundError as exc:
        missing.append(str(exc))
    try:
        es = await connect_event_store(settings)
    except EventStoreError as exc:
        missing.append(f"the reactors' dead letters could not be read ({exc})")
    else:
        try:
            entries += [
                DeadLetterEntry("reactor", d.reactor, d.position, d.subject, ",".join(e.type for e in d.events) or "?",
                                f"{d.reason.value}: {d.error}")
                for d in await read_reactor_dead_letters(es)
            ]
        finally:
            await es.close()
    return entries, "; ".join(missing) or None


async def drop_dead_letters(
    settings: ProjectionSettings, *, projection: str | None = None, reactor: str | None = None,
    position: int | None = None,
) -> int:
    """Forget the dead letters of ``projection`` or ``reactor`` (exactly one) at ``position`` (every one when
    None); returns how many there were."""
    if (projection is None) == (reactor is None):
        raise ProjectionError("Name either a projection (--projection) or a reactor (--reactor) to drop from.")
    if projection is not None:

        def drop() -> int:
            with contextlib.closing(open_store(settings, create=False)) as store:
                return store.drop_dead_letters(projection, position)

        return await asyncio.to_thread(drop)
    assert reactor is not None
    es = await connect_event_store(settings)
    try:
        return await drop_reactor_dead_letters(es, reactor, position)
    finally:
        await es.close()


def _projection_dead_letters(settings: ProjectionSettings) -> list[DeadLetterEntry]:
    with contextlib.closing(open_store(settings, create=False)) as store:
        return [
            DeadLetterEntry("projection", d.projection, d.position, d.stream_id, d.event_type,
                            d.error.splitlines()[0] if d.error else "")
            for status in store.statuses()
            for d in store.dead_letters(status.projection)
        ]


def format_dead_letters(entries: list[DeadLetterEntry]) -> str:
    """A plain-text table, one dead letter per line (errors cut to one line of at most 80 characters)."""
    if not entries:
        return "No dead letters."
    rows = [("kind", "name", "position", "stream", "type", "error")]
    rows += [(e.kind, e.name, str(e.position), e.stream, e.event_type, e.error[:80]) for e in entries]
    return "\n".join(aligned(rows))


async def retry_dead_letters(
    settings: ProjectionSettings, *, reactor: str | None = None, projection: str | None = None,
    position: int | None = None,
) -> RetryResult:
    """Run the reactor at import path ``reactor`` (``module:attribute``) on its dead letters at ``position`` (every
    one when None); a ``projection`` is refused with :data:`PROJECTION_RETRY`."""
    if projection is not None:
        raise ProjectionError(PROJECTION_RETRY)
    if reactor is None:
        raise ProjectionError("retry needs the reactor to run, as module:attribute (e.g. myapp.reactors:mailer).")
    try:
        loaded = import_object(reactor)
    except ImportPathError as exc:
        raise ProjectionError(str(exc)) from exc
    if not isinstance(loaded, Reactor):
        raise ProjectionError(f"{reactor!r} is {loaded!r:.80}, not a Reactor.")
    es = await connect_event_store(settings)
    try:
        return await retry_reactor_dead_letters(es, loaded, position)
    finally:
        await es.close()

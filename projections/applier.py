"""Applying batches of events to one generation of a read model: whole commits, exactly once, errors never silent.

One batch is one store transaction: the handlers' writes and the checkpoint
(the batch's last position) commit together, so a crash at any point leaves
either the whole batch applied or none of it, and the next run resumes from
the checkpoint. Batches always hold whole commits (the event store yields
every event of a stream message together).

When a handler raises, the batch is rolled back, the commits before the
failing one are applied and committed, and then the projection's error
policy decides: ``stop`` raises :class:`ProjectionStoppedError` (checkpoint =
the failing position - 1), ``dead_letter`` records the failing commit in the
dead-letter table in the same transaction that moves the checkpoint past it,
logs it, and goes on with the rest of the batch. A commit is applied whole or
not at all: a dead-lettered commit leaves no rows behind.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from eventstore import RecordedEvent

from .errors import CheckpointConflictError, HandlerError, ProjectionStoppedError
from .projection import ErrorPolicy, Projection
from .store import DeadLetter, Writer

__all__ = ["Applier", "Counters"]

log = logging.getLogger("projections")


@dataclass(slots=True)
class Counters:
    """What a runner or rebuild did, logged on shutdown and stored for ``status``."""

    batches: int = 0
    events: int = 0
    """Events passed to a handler."""
    skipped: int = 0
    """Events of types without a handler (never decoded)."""
    dead_lettered: int = 0
    conflicts: int = 0
    """Checkpoint conflicts (a rebuild switched generations, or another writer took over)."""
    checkpoint: int = 0
    started_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        """The counters as JSON-able data."""
        return asdict(self)

    def summary(self) -> str:
        """One human line, e.g. for the shutdown log."""
        seconds = max(time.time() - self.started_at, 1e-9)
        return (
            f"checkpoint {self.checkpoint}, {self.events} events applied, {self.skipped} skipped (unhandled types), "
            f"{self.dead_lettered} dead-lettered, {self.batches} batches, {self.conflicts} checkpoint conflicts "
            f"in {seconds:.1f}s ({(self.events + self.skipped) / seconds:,.0f} events/s)"
        )


class Applier:
    """Applies batches to ``writer``'s generation through ``projection``'s handlers. See the module docs."""

    def __init__(self, projection: Projection, writer: Writer, policy: ErrorPolicy, counters: Counters) -> None:
        self.projection = projection
        self.writer = writer
        self.policy = policy
        self.counters = counters
        counters.checkpoint = writer.checkpoint

    def apply(self, events: Sequence[RecordedEvent], through: int | None = None) -> None:
        """Apply ``events`` (whole commits, in order) and move the checkpoint to their last position (or ``through``).

        Raises :class:`ProjectionStoppedError` under the ``stop`` policy and
        :class:`CheckpointConflictError` when the writer lost the read model.
        Commits at or before the writer's checkpoint are already applied and
        skipped: a batch retried after a store failure part-way (some of its
        commits went in) applies each commit once.
        """
        checkpoint = self.writer.checkpoint
        if events and events[0].position <= checkpoint:
            events = [e for e in events if e.position > checkpoint]
        while events:
            failure = self._attempt(events, through)
            if failure is None:
                return
            i, error = failure
            position = events[i].position
            start = i
            while start > 0 and events[start - 1].position == position:
                start -= 1
            end = i + 1
            while end < len(events) and events[end].position == position:
                end += 1
            if start > 0:
                self.apply(events[:start])
            if self.policy is ErrorPolicy.STOP:
                raise ProjectionStoppedError(error)
            self._dead_letter(events[i], error)
            events = events[end:]
        if through is not None:
            self.advance(through)

    def advance(self, position: int) -> None:
        """Move the checkpoint to ``position`` without changes (the events up to it are known to be applied)."""
        if position > self.writer.checkpoint:
            self.writer.transaction().commit(position)
            self.counters.checkpoint = position

    def _attempt(self, events: Sequence[RecordedEvent], through: int | None) -> tuple[int, HandlerError] | None:
        handlers = self.projection.handlers
        tx = self.writer.transaction()
        applied = 0
        event = events[0]
        try:
            for event in events:
                handler = handlers.get(event.type)
                if handler is not None:
                    handler(event, tx)
                    applied += 1
        except CheckpointConflictError:
            tx.rollback()
            raise  # the store found this writer's generation switched away: not the event's fault
        except self.writer.transient_errors:
            tx.rollback()
            raise  # the database failed, not the event: the caller retries the batch
        except Exception as exc:  # noqa: BLE001 - any handler failure is reported, never swallowed
            tx.rollback()
            if not self.writer.touch():
                # Not the event's fault: the generation was switched away (its tables may be gone) or
                # another writer took over. Reload instead of blaming the event.
                raise CheckpointConflictError(
                    f"{self.projection.name}: generation {self.writer.generation.generation} is no longer this "
                    f"writer's (handler error on the way: {type(exc).__name__}: {exc})."
                ) from exc
            index = next(k for k, e in enumerate(events) if e is event)
            return index, self._error(event, exc)
        checkpoint = events[-1].position
        if through is not None and through > checkpoint:
            checkpoint = through
        tx.commit(checkpoint)
        counters = self.counters
        counters.batches += 1
        counters.events += applied
        counters.skipped += len(events) - applied
        counters.checkpoint = checkpoint
        return None

    def _error(self, event: RecordedEvent, exc: BaseException) -> HandlerError:
        error = HandlerError(
            self.projection.name,
            position=event.position,
            index=event.index,
            event_type=event.type,
            stream_id=str(event.stream_id),
            event_id=event.event_id,
            error=f"{type(exc).__name__}: {exc}",
            traceback="".join(traceback.format_exception(exc)),
        )
        error.__cause__ = exc
        return error

    def _dead_letter(self, event: RecordedEvent, error: HandlerError) -> None:
        tx = self.writer.transaction()
        tx.dead_letter(
            DeadLetter(
                projection=self.projection.name,
                generation=self.writer.generation.generation,
                position=event.position,
                index=event.index,
                stream_id=error.stream_id,
                event_type=error.event_type,
                event_id=error.event_id,
                error=error.error,
                traceback=error.traceback,
                recorded_at=event.recorded_at_text,
                dead_at=time.time(),
            )
        )
        tx.commit(event.position)
        self.counters.dead_lettered += 1
        self.counters.checkpoint = event.position
        log.error("%s -- dead-lettered (the commit is skipped, its other events too):\n%s", error, error.traceback)


def error_report(error: HandlerError) -> dict[str, Any]:
    """A stored, JSON-able report of a handler failure (shown by ``status``)."""
    return {
        "position": error.position,
        "index": error.index,
        "event_type": error.event_type,
        "stream_id": error.stream_id,
        "event_id": error.event_id,
        "error": error.error,
        "traceback": error.traceback,
        "at": time.time(),
    }

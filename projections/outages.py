"""The outage policy, applied to the read-model store: how the daemon and rebuilds outlive their database.

Every store call of a long-running process (a batch, a heartbeat, a claim, a run state, a rebuild's
shadow and switch) goes through :func:`ride_out_store`: a failure the store calls transient (a
connection refused, cut or timed out; a database busy or restarting) is retried with backoff, logged
once when the outage starts, every minute while it lasts and once when it ends
(:func:`eventstore.ride_out`), for as long as ``EventStoreSettings.outage_limit_s`` allows (by
default, for ever), or until the process is asked to stop. Each attempt ends by itself: the stores
bound every wait (for PostgreSQL, on the client's side too: :mod:`projections.postgres_deadline`).

Exactly once: a failed attempt of a batch rolled its transaction back whole, so the retry applies it
again from the writer's checkpoint. One failure is ambiguous: a COMMIT that reached the database
although its answer was lost. So a batch's retry (:func:`ride_out_batch`) first checks that its
writer still owns its generation at the checkpoint it knows; if not (that COMMIT went in, or a
rebuild switched generations meanwhile), it raises :class:`~projections.errors.CheckpointConflictError`
and the caller reloads from the stored checkpoint, as after any conflict.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from eventstore import RecordedEvent, ride_out

from .applier import Applier
from .errors import CheckpointConflictError
from .settings import ProjectionSettings
from .store import ReadModelStore

__all__ = ["ride_out_batch", "ride_out_store"]

log = logging.getLogger("projections")

T = TypeVar("T")


async def ride_out_store(
    store: ReadModelStore,
    fn: Callable[..., T],
    *args: Any,
    what: str,
    settings: ProjectionSettings,
    stop: asyncio.Event | None = None,
    again: Callable[..., T] | None = None,
) -> T:
    """``fn(*args)`` in the store's thread, retried while it fails with one of ``store.transient_errors``.

    Gives up, raising the last failure, when the outage has lasted ``settings.eventstore.outage_limit_s``
    or once ``stop`` is set; any other error is raised at once. ``again`` (with the same arguments)
    replaces ``fn`` from the second attempt on: a call whose first attempt may have taken effect although
    it failed checks that first. ``what`` names the call in the log ("balances: a batch").
    """
    retrying = False

    async def attempt() -> T:
        nonlocal retrying
        call = again if retrying and again is not None else fn
        retrying = True
        return await store.offload(call, *args)

    return await ride_out(
        attempt,
        what=f"{what} in the read-model database ({settings.database_name})",
        logger=log,
        transient=lambda exc: isinstance(exc, store.transient_errors),
        limit_s=settings.eventstore.outage_limit_s,
        stop=stop,
    )


async def ride_out_batch(
    store: ReadModelStore,
    applier: Applier,
    events: Sequence[RecordedEvent],
    through: int | None,
    *,
    what: str,
    settings: ProjectionSettings,
    stop: asyncio.Event | None = None,
) -> None:
    """Apply one batch (``events``, or only move the checkpoint to ``through`` when there are none) through
    an outage, exactly once (see the module docs); :class:`CheckpointConflictError` means: reload."""
    await ride_out_store(store, _apply, applier, events, through, what=what, settings=settings, stop=stop,
                         again=_apply_again)


def _apply(applier: Applier, events: Sequence[RecordedEvent], through: int | None) -> None:
    if events:
        applier.apply(events, through)
    elif through is not None:
        applier.advance(through)


def _apply_again(applier: Applier, events: Sequence[RecordedEvent], through: int | None) -> None:
    writer = applier.writer
    if not writer.touch():
        raise CheckpointConflictError(
            f"{applier.projection.name}: generation {writer.generation.generation} is no longer at checkpoint "
            f"{writer.checkpoint} owned by {writer.owner} (the failed attempt's commit went in, or a rebuild "
            "switched generations): reloading."
        )
    _apply(applier, events, through)

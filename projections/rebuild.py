"""Rebuild by replay: a fresh shadow generation filled from the first event, then an atomic switch.

1. Take the projection's *rebuild* lease (one rebuild at a time per store).
2. Create an empty shadow generation (new physical tables; leftovers of
   earlier rebuilds are dropped first), or, with ``resume=True``, take over
   the generation an interrupted rebuild of the same version and definition
   left behind and go on from its checkpoint.
3. Replay every event from position 1 to the stream's last position into it
   (``read_all``: an ephemeral ordered pull consumer starting at sequence 1),
   in large batches, each committed with the shadow's checkpoint.
4. Catch up: replay again up to the new last position until the shadow's
   checkpoint has reached the live generation's, then switch readers in one
   store transaction (:meth:`ReadModelStore.switch`: for SQLite, views
   re-pointed and the live generation flipped). If the live daemon moved
   ahead meanwhile, the switch changes nothing and step 4 repeats.

Every store call waits out an outage of the read-model database (a
restarted, unreachable or frozen server; :mod:`projections.outages`); when a
batch's COMMIT went in although its answer was lost, the rebuild takes its
generation up again at the stored checkpoint, so no event is applied twice.
A lost or restarting NATS server is waited out too, under the same policy
(``outage_limit_s``): the replay goes on from the shadow's checkpoint.

Meanwhile readers keep querying the old generation, which the daemon keeps
updating. A rebuild that fails, is cancelled or is killed leaves the old
model live and untouched. What happens to its half-built shadow depends on
why it ended: a projection error drops it; an interruption (``stop``, a
signal, cancellation, a lost lease, an outage past its limit, a killed process) keeps it,
checkpoint and all, for a ``resume=True`` rebuild (``jetsourcing rebuild
--resume``; the daemon's automatic rebuilds always resume). A rebuild without
``resume`` drops it and starts from the first event. After the switch the daemon notices that its checkpoint
moved (its next commit is refused), reloads, and follows from the new
generation's checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from nats.js.kv import KeyValue

from eventstore import EventStore, EventStoreClosedError, RecordedEvent, ServerUnavailableError, ride_out

from .applier import Applier, Counters
from .backends import open_store
from .connection import connect_event_store, lease_key
from .errors import CheckpointConflictError, ProjectionError, RebuildError
from .lease import Lease, new_owner_id, open_lease_bucket
from .outages import ride_out_batch, ride_out_store
from .progress import NoProgress, ProgressReporter
from .projection import Projection
from .settings import ProjectionSettings
from .store import Generation, ReadModelStore, Writer

__all__ = ["RebuildResult", "rebuild"]

log = logging.getLogger("projections")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RebuildResult:
    """What a finished rebuild switched in."""

    projection: str
    generation: int
    checkpoint: int
    events: int
    """Events replayed (handled and skipped)."""
    dead_lettered: int
    seconds: float

    @property
    def events_per_s(self) -> float:
        """Replay throughput."""
        return self.events / self.seconds if self.seconds > 0 else 0.0


async def rebuild(
    projection: Projection,
    settings: ProjectionSettings | None = None,
    *,
    event_store: EventStore | None = None,
    store: ReadModelStore | None = None,
    kv: KeyValue | None = None,
    owner: str | None = None,
    progress: ProgressReporter | None = None,
    stop: asyncio.Event | None = None,
    resume: bool = False,
) -> RebuildResult:
    """Rebuild ``projection``'s read model by replaying the whole stream into a shadow, then switch readers.

    Raises :class:`RebuildError` if another rebuild of it is running, if
    this one fails, or if ``stop`` is set before the switch (the old model
    stays live in every case). ``resume=True`` goes on with the shadow an
    interrupted rebuild of the same version and definition kept (see the
    module docs), or starts afresh if there is none. Connections not given
    are opened from ``settings`` and closed again; meanwhile a JetStream that
    elects a leader is waited out as the outage policy says (``outage_limit_s``).
    """
    settings = settings or ProjectionSettings()
    own_es = event_store is None
    es = event_store or await connect_event_store(settings, long_running=True, stop=stop)
    own_store = store is None
    try:
        rm = store if store is not None else await asyncio.to_thread(open_store, settings)
    except BaseException:
        if own_es:
            await es.close()
        raise
    try:
        projection.bind(es.registry)
        if kv is None:
            kv, ttl = await open_lease_bucket(
                es.nc, settings.lease_bucket, settings.lease_ttl_s, replicas=es.settings.replicas,
                limit_s=es.settings.outage_limit_s, stop=stop,
            )
        else:
            ttl = settings.lease_ttl_s
        me = owner or new_owner_id()
        lease = Lease(kv, lease_key(rm.store_id, projection.name, "rebuild"), me, ttl,
                      request_timeout_s=settings.eventstore.request_timeout_s)
        if not await lease.try_acquire():
            raise RebuildError(
                f"A rebuild of {projection.name!r} is already running ({await lease.holder()}). Wait for it to finish."
            )
        try:
            with _fewer_gc_pauses():
                return await _rebuild(projection, settings, es, rm, lease, me, progress or NoProgress(),
                                      stop or asyncio.Event(), resume)
        finally:
            await lease.release()
    finally:
        if own_store:
            await rm.aclose()
        if own_es:
            await es.close()


def _switch_again(rm: ReadModelStore, shadow: Generation) -> bool:
    """A switch retried after a failure: the failed attempt's COMMIT may have gone in."""
    live = rm.live_generation(shadow.projection)
    if live is not None and live.generation == shadow.generation:
        return True
    return rm.switch(shadow)


async def _abandon(rm: ReadModelStore, writer: Writer, owner: str, *, keep: bool) -> None:
    """Release an unfinished shadow for a later resume (``keep``), or drop it."""
    shadow = writer.generation
    try:
        if keep:
            await rm.offload(rm.release_shadow, shadow, owner)
            log.info("%s: kept generation %d at position %d for a resumed rebuild.", shadow.projection,
                     shadow.generation, writer.checkpoint)
        else:
            await rm.offload(rm.discard, shadow.projection, shadow.generation, owner)
    except Exception:  # noqa: BLE001 - the next rebuild drops or takes it over anyway
        log.warning("%s: could not %s the abandoned generation %d.", shadow.projection, "release" if keep else "drop",
                    shadow.generation)


@contextlib.contextmanager
def _fewer_gc_pauses() -> Iterator[None]:
    """Collect the youngest generation less often while replaying.

    A replay allocates millions of short-lived, acyclic objects (messages,
    events, rows); the default threshold (700) runs the collector thousands
    of times for nothing, about 8% of a replay's time. Restored afterwards.
    """
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], 100_000), old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)


async def _rebuild(
    projection: Projection,
    settings: ProjectionSettings,
    es: EventStore,
    rm: ReadModelStore,
    lease: Lease,
    owner: str,
    progress: ProgressReporter,
    stop: asyncio.Event,
    resume: bool,
) -> RebuildResult:
    stream = settings.eventstore.stream
    name = projection.name

    async def store_call(what: str, fn: Callable[..., T], *args: Any, again: Callable[..., T] | None = None) -> T:
        return await ride_out_store(rm, fn, *args, what=f"{name}: {what}", settings=settings, stop=stop, again=again)

    await store_call("creating its read model", rm.ensure_live, projection, stream)
    started = time.monotonic()
    target = await es.last_position()
    shadow = await store_call("taking up the kept rebuild", rm.resume_shadow, projection, stream, owner,
                              target) if resume else None
    if shadow is not None:
        log.info("%s: resuming generation %d from checkpoint %d (positions up to %d).", name, shadow.generation,
                 shadow.checkpoint, target)
    else:
        shadow = await store_call("creating a generation", rm.create_shadow, projection, stream, owner, target)
        log.info("%s: rebuilding into generation %d (positions 1..%d).", name, shadow.generation, target)
    writer = await store_call("opening the new generation", rm.writer, shadow, owner)
    counters = Counters()
    policy = settings.error_policy or projection.error_policy
    applier = Applier(projection, writer, policy, counters)
    batch = settings.rebuild_batch_size
    progress.start(target, writer.checkpoint)
    switched = False

    async def apply(events: list[RecordedEvent], through: int) -> None:
        nonlocal writer, applier
        while True:
            try:
                await ride_out_batch(rm, applier, events, through, what=f"{name}: a rebuild batch", settings=settings,
                                     stop=stop)
                return
            except CheckpointConflictError:
                if lease.lost.is_set() or not await lease.confirm():
                    raise RebuildError(f"The rebuild lease of {name!r} was lost; abandoning the rebuild.") from None
            # This rebuild holds the lease, so its shadow moved under its own failed attempt (whose COMMIT went
            # in): take the shadow up again at its stored checkpoint; the batch's events up to it are skipped.
            again = await store_call("taking up the new generation", rm.resume_shadow, projection, stream, owner,
                                     target)
            if again is None or again.generation != shadow.generation:
                raise RebuildError(f"Generation {shadow.generation} of {name!r} is gone (another rebuild replaced it?).")
            await rm.offload(writer.close)
            writer = await store_call("opening the new generation", rm.writer, again, owner)
            applier = Applier(projection, writer, policy, counters)
            log.info("%s: the new generation is at checkpoint %d after a failed attempt; going on from there.", name,
                     writer.checkpoint)

    async def replay_to(upto: int) -> None:
        # From the shadow's checkpoint on: a pass that a lost server broke goes on where it was.
        async for events in es.replay(from_position=writer.checkpoint + 1, to_position=upto,
                                      categories=projection.categories, types=projection.handled_types,
                                      batch=batch):
            if lease.lost.is_set():
                raise RebuildError(f"The rebuild lease of {name!r} was lost; abandoning the rebuild.")
            if stop.is_set():
                raise RebuildError(f"Rebuild of {name!r} cancelled; readers still see the old model.")
            counters.skipped += events.skipped
            await apply(events.events, events.last_position)
            progress.update(writer.checkpoint)

    async def nats(call: Callable[[], Awaitable[T]], what: str) -> T:
        """``call`` under the outage policy for NATS: a lost or restarting server is waited out."""
        return await ride_out(call, what=f"{name}: {what}", logger=log,
                              transient=lambda exc: isinstance(exc, ServerUnavailableError),
                              limit_s=es.settings.outage_limit_s, stop=stop)

    try:
        upto = target
        while True:
            await nats(partial(replay_to, upto), "replaying the stream")
            await apply([], upto)
            progress.update(writer.checkpoint)
            if stop.is_set():
                raise RebuildError(f"Rebuild of {name!r} cancelled; readers still see the old model.")
            # The shadow has every event up to `upto`: switch if that covers what the live model has applied.
            if await store_call("switching readers", rm.switch, writer.generation,
                                again=partial(_switch_again, rm)):
                switched = True
                break
            upto = await nats(es.last_position, "reading the stream's last position")
            progress.update(writer.checkpoint, upto)
            await asyncio.sleep(0)
    except BaseException as exc:
        # A projection error or a malformed commit would recur on resume: drop the shadow. An
        # interruption (a stop, a lost lease or server, a killed task) keeps it to resume.
        interrupted = (stop.is_set() or lease.lost.is_set()
                       or isinstance(exc, (ServerUnavailableError, EventStoreClosedError, *rm.transient_errors))
                       or not isinstance(exc, Exception))
        if not switched:
            await _abandon(rm, writer, owner, keep=interrupted)
        if not isinstance(exc, Exception):
            raise
        kept = (f" Its progress (generation {shadow.generation}, position {writer.checkpoint} of {target}) is kept: "
                "rebuild with resume=True (jetsourcing rebuild --resume) to go on from there." if interrupted else "")
        if isinstance(exc, RebuildError):
            if kept:
                raise RebuildError(f"{exc}{kept}") from exc.__cause__
            raise
        if stop.is_set():  # stopped while the read-model database was failing
            raise RebuildError(f"Rebuild of {name!r} cancelled; readers still see the old model.{kept}") from exc
        if isinstance(exc, ProjectionError):
            raise RebuildError(f"Rebuild of {projection.name!r} failed; readers still see the old model: {exc}") from exc
        raise RebuildError(
            f"Rebuild of {projection.name!r} failed ({type(exc).__name__}: {exc}); readers still see the old model.{kept}"
        ) from exc
    finally:
        progress.finish()
        await rm.offload(writer.close)
    seconds = time.monotonic() - started
    result = RebuildResult(
        projection.name,
        shadow.generation,
        writer.checkpoint,
        counters.events + counters.skipped,
        counters.dead_lettered,
        seconds,
    )
    log.info(
        "%s: switched readers to generation %d at checkpoint %d; %s",
        projection.name, shadow.generation, writer.checkpoint, counters.summary(),
    )
    return result

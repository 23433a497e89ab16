"""The projection daemon: keeps read models up to date, one runner per projection.

Each :class:`ProjectionRunner`:

1. waits for the projection's lease (a second daemon waits here and takes over
   within one lease TTL when the first dies);
2. claims the live generation; rebuilds first if the declared ``version`` is
   newer than the stored one (``auto_rebuild``); refuses to run on a read
   model built by a newer version, from another stream, or with different
   tables under the same version;
3. catches up from the checkpoint, then follows live
   (:meth:`EventStore.subscribe` survives server restarts), applying each
   batch with its checkpoint in one store transaction;
4. on a checkpoint conflict (a rebuild switched generations), reloads and
   resumes; on a lost lease, goes back to 1; waits out an outage of the
   read-model database (a restarted, unreachable or frozen server) as it
   does one of NATS (:mod:`projections.outages`): every store call is retried
   with backoff until it works, for at most ``outage_limit_s`` if set;
5. stops on a handler failure under the ``stop`` policy (full report stored
   for ``status``; the other projections keep running), on :meth:`Daemon.stop`
   (SIGINT/SIGTERM: the batch in hand is committed or rolled back as a whole,
   the lease released, counters logged), or in burst mode once it has reached
   the stream's last position at start.

Example::

    daemon = Daemon([AccountBalances()], ProjectionSettings(database="views.sqlite3"))
    await daemon.run()                       # until daemon.stop()
    await daemon.run(until_caught_up=True)   # burst mode
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from nats.js.kv import KeyValue

from eventstore import EventStore, EventStoreError, RecordedEvent, Replayed, ServerUnavailableError, stop_task

from .applier import Applier, Counters, error_report
from .backends import open_store
from .connection import connect_event_store, lease_key
from .errors import CheckpointConflictError, ProjectionStoppedError, ReadModelMismatchError, RebuildError
from .lease import Lease, new_owner_id, open_lease_bucket
from .metrics import PROJECTION_CHECKPOINT, PROJECTION_EVENTS, PROJECTION_LAG, serving
from .outages import ride_out_batch, ride_out_store
from .progress import progress_for
from .projection import Projection, check_distinct_tables
from .rebuild import rebuild
from .settings import ProjectionSettings
from .shutdown import SignalShutdown
from .store import Generation, ReadModelStore, RunState, Writer

__all__ = ["Daemon", "Outcome", "ProjectionRunner", "SignalShutdown", "run_daemon"]

log = logging.getLogger("projections")

T = TypeVar("T")


class Outcome(str, enum.Enum):
    """How a runner ended."""

    CAUGHT_UP = "caught_up"
    """Burst mode: the read model reached the stream's last position at start."""
    STOPPED = "stopped"
    """Asked to stop (signal or :meth:`Daemon.stop`)."""
    ERROR = "error"
    """Stopped by a handler failure (``stop`` policy) or an unusable read model; see ``status``."""


class _Reload(Exception):
    """Internal: the live generation changed under the runner; claim it again."""


class _Stopped(Exception):
    """Internal: asked to stop while preparing (e.g. during an automatic rebuild)."""


class ProjectionRunner:
    """Runs one projection until stopped (see the module docs). Not reusable."""

    def __init__(
        self,
        projection: Projection,
        event_store: EventStore,
        settings: ProjectionSettings,
        kv: KeyValue,
        lease_ttl_s: float,
        stop: asyncio.Event,
        *,
        until_caught_up: bool = False,
        owner: str | None = None,
    ) -> None:
        self.projection = projection
        self.es = event_store
        self.settings = settings
        self.kv = kv
        self.lease_ttl_s = lease_ttl_s
        self.stop_event = stop
        self.until_caught_up = until_caught_up
        self.owner = owner or new_owner_id()
        self.counters = Counters()
        self.policy = settings.error_policy or projection.error_policy
        self.name = projection.name

    async def run(self) -> Outcome:
        """Run until stopped, caught up (burst mode) or failed; never raises for a handler failure."""
        outcome = Outcome.STOPPED
        try:
            store = await asyncio.to_thread(open_store, self.settings)
        except Exception as exc:  # noqa: BLE001 - one projection's failure must not stop the others
            log.error("%s: cannot open the read-model store: %s", self.name, exc)
            return Outcome.ERROR
        try:
            await self._store(store, "creating its read model", store.ensure_live, self.projection,
                              self.settings.eventstore.stream)
            lease = Lease(self.kv, lease_key(store.store_id, self.name), self.owner, self.lease_ttl_s,
                          request_timeout_s=self.settings.eventstore.request_timeout_s)
            while not self.stop_event.is_set():
                if not await lease.acquire(self.stop_event):
                    break
                try:
                    result = await self._own(store, lease)
                finally:
                    await lease.release()
                if result is not None:
                    outcome = result
                    break
        except _Stopped:
            pass  # asked to stop while the read-model database was failing: it cannot record the stop
        except store.transient_errors as exc:
            # The outage outlasted outage_limit_s (logged when it gave up); the database cannot record it.
            log.error("%s: stopped: the read-model database is not available (%s).", self.name, exc)
            outcome = Outcome.ERROR
        except Exception as exc:  # noqa: BLE001 - one projection's failure must not stop the others
            if isinstance(exc, ServerUnavailableError):
                # NATS stayed away past outage_limit_s: the message names the server; a traceback adds nothing.
                log.error("%s: stopped: %s", self.name, exc)
            else:
                log.exception("%s: stopped by an unexpected error.", self.name)
            with contextlib.suppress(Exception):
                await store.offload(
                    partial(store.set_state, self.name, RunState.ERROR, owner=self.owner,
                            counters=self.counters.as_dict(),
                            error={"error": f"{type(exc).__name__}: {exc}", "at": time.time()})
                )
            outcome = Outcome.ERROR
        finally:
            await store.aclose()
            log.info("%s: %s -- %s", self.name, outcome.value, self.counters.summary())
        return outcome

    async def _store(self, store: ReadModelStore, what: str, fn: Callable[..., T], *args: Any) -> T:
        """A store call through an outage (see :mod:`projections.outages`); a stop during the outage raises
        :class:`_Stopped`."""
        try:
            return await ride_out_store(store, fn, *args, what=f"{self.name}: {what}", settings=self.settings,
                                        stop=self.stop_event)
        except store.transient_errors:
            if self.stop_event.is_set():
                raise _Stopped from None
            raise

    async def _set_state(self, store: ReadModelStore, state: RunState, error: dict[str, Any] | None = None) -> None:
        await self._store(store, f"recording the state {state.value!r}",
                          partial(store.set_state, self.name, state, owner=self.owner, counters=self.counters.as_dict(),
                                  error=error))

    async def _stopped(self, store: ReadModelStore) -> Outcome:
        """Record the stop, if the database lets it (``status`` shows a stop it missed as stale)."""
        try:
            await self._set_state(store, RunState.STOPPED)
        except _Stopped:
            log.warning("%s: stopping without recording it: the read-model database is not available.", self.name)
        return Outcome.STOPPED

    # -- owning the projection ----------------------------------------------

    async def _own(self, store: ReadModelStore, lease: Lease) -> Outcome | None:
        """Work while holding the lease; None means "the lease was lost, wait for it again"."""
        while True:
            try:
                writer = await self._claim(store, lease)
            except _Stopped:
                return await self._stopped(store)
            except ReadModelMismatchError as exc:
                log.error("%s", exc)
                await self._set_state(store, RunState.ERROR, {"error": str(exc), "at": time.time()})
                return Outcome.ERROR
            try:
                return await self._follow(store, writer, lease)
            except _Stopped:
                return await self._stopped(store)
            except _Reload:
                self.counters.conflicts += 1
                await store.offload(writer.close)
                if lease.lost.is_set() or not await lease.confirm():
                    return None
                log.info("%s: the read model's checkpoint moved under this daemon (a rebuild's switch, or a commit "
                         "whose answer was lost); reloading.", self.name)

    async def _claim(self, store: ReadModelStore, lease: Lease) -> Writer:
        gen = await self._store(store, "claiming its read model", store.claim, self.name, self.owner)
        problem = self._mismatch(gen)
        if problem == "rebuild":
            if not self.settings.auto_rebuild:
                raise ReadModelMismatchError(
                    f"{self.name}: the read model is version {gen.version}, the code declares version "
                    f"{self.projection.version}: run `jetsourcing rebuild` (auto_rebuild is off)."
                )
            log.info("%s: read model is version %d, code is version %d: rebuilding (readers keep the old model).",
                     self.name, gen.version, self.projection.version)
            try:
                # Resume: a daemon stopped or killed during this rebuild goes on where it was.
                await rebuild(self.projection, self.settings, event_store=self.es, store=store, kv=self.kv,
                              owner=self.owner, progress=progress_for(f"rebuild {self.name}"), stop=self.stop_event,
                              resume=True)
            except RebuildError:
                if self.stop_event.is_set():
                    raise _Stopped from None  # the half-built generation is kept to resume; readers keep the old model
                raise
            gen = await self._store(store, "claiming its read model", store.claim, self.name, self.owner)
            problem = self._mismatch(gen)
        if problem:
            raise ReadModelMismatchError(problem)
        log.info("%s: owning generation %d (version %d) at checkpoint %d.", self.name, gen.generation, gen.version,
                 gen.checkpoint)
        return await self._store(store, "opening its read model", store.writer, gen, self.owner)

    def _mismatch(self, gen: Generation) -> str | None:
        p = self.projection
        stream = self.settings.eventstore.stream
        if gen.stream != stream:
            return (f"{self.name}: the read model was built from stream {gen.stream!r}, not {stream!r}. Use another "
                    "database file, or rebuild it from this stream.")
        if gen.version > p.version:
            return (f"{self.name}: the read model is version {gen.version}, newer than this code's version "
                    f"{p.version}. Deploy the newer code (a daemon never downgrades a read model).")
        if gen.version < p.version:
            return "rebuild"
        if gen.definition.get("tables") != p.describe()["tables"] or gen.definition.get("categories") != p.describe()[
            "categories"
        ]:
            return (f"{self.name}: tables or categories changed but the version is still {p.version}. Bump `version` "
                    "so the read model is rebuilt.")
        return None

    # -- following ------------------------------------------------------------

    def _source(self, writer: Writer, target: int | None) -> AsyncIterator[Replayed]:
        """The projection's events after the checkpoint: up to ``target``, or live; unhandled types undecoded."""
        p = self.projection
        if target is not None:
            return self.es.replay(from_position=writer.checkpoint + 1, to_position=target, categories=p.categories,
                                  types=p.handled_types, batch=self.settings.batch_size)
        return self.es.replay(from_position=writer.checkpoint + 1, live=True, categories=p.categories,
                              types=p.handled_types, batch=self.settings.batch_size,
                              heartbeat_s=self.settings.heartbeat_s)

    async def _follow(self, store: ReadModelStore, writer: Writer, lease: Lease) -> Outcome | None:
        applier = Applier(self.projection, writer, self.policy, self.counters)
        target = await self.es.last_position() if self.until_caught_up else None
        if target is not None:
            log.info("%s: catching up from %d to %d (burst mode).", self.name, writer.checkpoint, target)
        source = self._source(writer, target)
        next_batch: asyncio.Task[Replayed] | None = None
        stop_wait = asyncio.ensure_future(self.stop_event.wait())
        lost_wait = asyncio.ensure_future(lease.lost.wait())
        interval = self.settings.status_interval_s
        last_touch = time.monotonic()
        try:
            while True:
                if next_batch is None:
                    next_batch = asyncio.ensure_future(source.__anext__())
                done, _ = await asyncio.wait(
                    {next_batch, stop_wait, lost_wait}, timeout=interval, return_when=asyncio.FIRST_COMPLETED
                )
                if next_batch in done:
                    task, next_batch = next_batch, None
                    try:
                        batch = task.result()
                    except StopAsyncIteration:
                        await self._apply(store, applier, [], through=target)
                        PROJECTION_CHECKPOINT.labels(self.name).set(writer.checkpoint)
                        await self._stopped(store)
                        log.info("%s: caught up to position %d.", self.name, writer.checkpoint)
                        return Outcome.CAUGHT_UP
                    if lease.lost.is_set():
                        raise _Reload  # never apply without the lease; the batch is read again by the next owner
                    self.counters.skipped += batch.skipped
                    try:
                        await self._apply(store, applier, batch.events, through=batch.last_position)
                        PROJECTION_EVENTS.labels(self.name).inc(len(batch.events))
                        PROJECTION_CHECKPOINT.labels(self.name).set(writer.checkpoint)
                    except ProjectionStoppedError as exc:
                        failure = exc.failure
                        log.error("%s\n%s", exc, failure.traceback)
                        await self._set_state(store, RunState.ERROR, error_report(failure))
                        return Outcome.ERROR
                if self.stop_event.is_set():
                    return await self._stopped(store)
                if lease.lost.is_set():
                    raise _Reload
                now = time.monotonic()
                if now - last_touch >= interval:
                    if not await self._store(store, "the heartbeat", writer.touch, self.counters.as_dict()):
                        raise _Reload
                    last_touch = time.monotonic()
                    if serving():
                        with contextlib.suppress(EventStoreError):  # a lost server shows in the daemon's own logs
                            last = await self.es.last_position()
                            PROJECTION_LAG.labels(self.name).set(max(0, last - writer.checkpoint))
        finally:
            # Bounded: a read inside a nats-py request can swallow its cancellation (see eventstore.tasks).
            timeout_s = self.settings.eventstore.request_timeout_s
            futures = [f for f in (next_batch, stop_wait, lost_wait) if f is not None]
            for future in futures:
                future.cancel()  # all at once, so none is left running if this stop is itself cancelled
            for future in futures:
                await stop_task(future, timeout_s=timeout_s)
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await stop_task(asyncio.ensure_future(aclose()), grace_s=timeout_s, timeout_s=timeout_s + 1.0)

    async def _apply(
        self, store: ReadModelStore, applier: Applier, events: list[RecordedEvent], through: int | None = None
    ) -> None:
        """Apply one batch (in the store's thread) through an outage of the database, exactly once; a checkpoint
        conflict means reload (see :mod:`projections.outages`)."""
        try:
            await ride_out_batch(store, applier, events, through, what=f"{self.name}: a batch", settings=self.settings,
                                 stop=self.stop_event)
        except CheckpointConflictError:
            raise _Reload from None
        except store.transient_errors:
            if self.stop_event.is_set():
                raise _Stopped from None  # rolled back whole: the next owner applies it
            raise


class Daemon:
    """Runs several projections side by side on one event-store connection.

    Guarantees: each projection has its own runner, lease, store connection
    and error state; one projection failing never stops the others.
    """

    def __init__(
        self,
        projections: Sequence[Projection],
        settings: ProjectionSettings | None = None,
        *,
        event_store: EventStore | None = None,
    ) -> None:
        if not projections:
            raise ValueError("Give the daemon at least one projection.")
        names = [p.name for p in projections]
        if len(set(names)) != len(names):
            raise ValueError(f"Each projection may run once per daemon; got {names}.")
        check_distinct_tables(projections)
        self.projections = list(projections)
        self.settings = settings or ProjectionSettings()
        self.event_store = event_store
        self.owner = new_owner_id()
        self._stop = asyncio.Event()
        self.outcomes: dict[str, Outcome] = {}

    def stop(self) -> None:
        """Ask every runner to finish its batch, commit, release its lease and return."""
        self._stop.set()

    async def run(self, *, until_caught_up: bool = False) -> dict[str, Outcome]:
        """Run every projection until :meth:`stop` (or, with ``until_caught_up``, until each has caught up)."""
        self._stop = asyncio.Event()
        # Fail at once, in one error, when the read-model database cannot be used (each runner opens its own).
        await asyncio.to_thread(lambda: open_store(self.settings).close())
        try:  # a JetStream that elects a leader is waited out at start (the outage policy), until stop()
            es = self.event_store or await connect_event_store(self.settings, long_running=True, stop=self._stop)
        except ServerUnavailableError:
            if self._stop.is_set():
                return {p.name: Outcome.STOPPED for p in self.projections}
            raise
        try:
            for projection in self.projections:
                projection.bind(es.registry)
            try:
                kv, ttl = await open_lease_bucket(
                    es.nc, self.settings.lease_bucket, self.settings.lease_ttl_s, replicas=es.settings.replicas,
                    limit_s=es.settings.outage_limit_s, stop=self._stop,
                )
            except ServerUnavailableError:
                if self._stop.is_set():
                    return {p.name: Outcome.STOPPED for p in self.projections}
                raise
            runners = [
                ProjectionRunner(p, es, self.settings, kv, ttl, self._stop, until_caught_up=until_caught_up,
                                 owner=f"{self.owner}:{p.name}")
                for p in self.projections
            ]
            results = await asyncio.gather(*(r.run() for r in runners))
            self.outcomes = {r.name: o for r, o in zip(runners, results)}
            return self.outcomes
        finally:
            if self.event_store is None:
                await es.close()


def run_daemon(
    projections: Sequence[Projection], settings: ProjectionSettings | None = None, *, until_caught_up: bool = False
) -> int:
    """Run a :class:`Daemon` in a new event loop, stopping cleanly on SIGINT/SIGTERM (see :class:`SignalShutdown`).

    Returns the process exit code: 0 when every projection stopped or caught
    up (130 when a Ctrl-C stopped them, as shells expect), 1 when any stopped
    with an error, 128 + the signal's number when the stop had to be forced.
    """
    daemon = Daemon(projections, settings)
    shutdown = SignalShutdown(daemon.stop, daemon.settings.shutdown_timeout_s)

    def exit_code(outcomes: dict[str, Outcome]) -> int:
        code = _exit_code(outcomes)
        return 128 + signal.SIGINT.value if code == 0 and shutdown.first_signal is signal.SIGINT else code

    try:
        outcomes = shutdown.run(daemon.run(until_caught_up=until_caught_up), exit_code=exit_code)
    except asyncio.CancelledError:
        return shutdown.exit_code
    return exit_code(outcomes)


def _exit_code(outcomes: dict[str, Outcome]) -> int:
    return 1 if any(o is Outcome.ERROR for o in outcomes.values()) else 0

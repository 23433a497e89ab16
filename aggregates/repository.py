"""Repositories: load aggregates by replaying their events, save their pending events, run commands.

Example::

    accounts = Repository(store, Account, snapshot_every=500)

    await accounts.execute("alice", lambda a: a.open(owner="Alice"), create=True)
    await accounts.execute("alice", lambda a: a.deposit(100), command_id=request_id)

    alice = await accounts.get("alice")               # replay (from a snapshot when there is one)
    before = await accounts.get("alice", version=1)   # time travel
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar, cast, overload
from uuid import UUID

from eventstore import (
    NO_STREAM,
    ConcurrencyError,
    EntityAppend,
    EventLog,
    EventStore,
    InvalidArgumentError,
    RecordedEvent,
    StreamId,
)
from eventstore.validation import check_bool, check_int
from eventstore.wire import check_metadata

from .aggregate import Aggregate
from .commands import CacheStats, CommandResult, RetryPolicy
from .errors import AggregateExistsError, AggregateNotFoundError
from .events import register_events
from .metrics import AGGREGATE_CACHE, labelled
from .snapshots import Snapshot, SnapshotStore

__all__ = ["Repository"]

log = logging.getLogger("jetsourcing.aggregates")

_CACHE_FIELDS = {"hit": "hits", "stale": "stale", "miss": "misses"}

A = TypeVar("A", bound=Aggregate[Any])
R = TypeVar("R")


class _CountedLock(asyncio.Lock):
    """A lock that knows how many tasks hold or wait for it, so idle ones can be dropped."""

    users = 0


class Repository(Generic[A]):
    """Loads and saves one aggregate type through an :class:`~eventstore.EventStore` (or, in domain tests, an
    :class:`~eventstore.InMemoryEventStore`).

    Guarantees:

    * Constructing it registers the aggregate's event types (and their
      upcasters) in ``store.registry``.
    * :meth:`get` returns the aggregate as replaying all its stored events
      would, whether it comes from a snapshot, the cache or a full replay.
    * :meth:`save` and :meth:`save_all` store pending events only if no one
      else wrote to the aggregates since they were loaded, atomically, or
      raise :class:`~eventstore.ConcurrencyError` and store nothing.

    ``snapshot_every=N`` keeps a snapshot of the state every N events (see
    :mod:`aggregates.snapshots`); ``cache_size`` keeps that many recently used
    aggregates in memory, which saves :meth:`execute` its load. The cache is
    safe with other writers: a stale entry only costs a conflict and a retry.

    Safe for many concurrent tasks on one event loop; commands on one
    aggregate through one repository take turns.
    """

    def __init__(
        self,
        store: EventLog,
        aggregate_type: type[A],
        *,
        snapshot_every: int | None = None,
        snapshot_version: int = 1,
        cache_size: int = 1000,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.store = store
        self.aggregate_type = aggregate_type
        self.retry = retry
        self.cache_size = cache_size
        self._cache: OrderedDict[str, A] = OrderedDict()
        self.cache_stats = CacheStats()
        """How this repository's commands found their aggregate in the cache (see :class:`CacheStats`)."""
        self._locks: dict[str, _CountedLock] = {}
        self._registered: set[type[Aggregate[Any]]] = set()
        self._register(aggregate_type)
        if snapshot_every and not isinstance(store, EventStore):
            raise InvalidArgumentError(
                f"Snapshots live in JetStream: snapshot_every needs an EventStore, not {type(store).__name__} "
                "(test snapshots against the embedded server)."
            )
        self._snapshots = (
            SnapshotStore(
                store,  # type: ignore[arg-type]  # an EventStore, checked above
                aggregate_type.category,
                aggregate_type.state_type,
                every=snapshot_every,
                snapshot_version=snapshot_version,
            )
            if snapshot_every
            else None
        )

    async def open_snapshots(self, *, long_running: bool = False, stop: asyncio.Event | None = None) -> None:
        """Open the snapshot bucket ahead of the first command (nothing without ``snapshot_every``); never raises.

        See :meth:`SnapshotStore.open <aggregates.snapshots.SnapshotStore.open>` for how long it waits."""
        if self._snapshots is not None:
            await self._snapshots.open(long_running=long_running, stop=stop)

    def _register(self, aggregate_type: type[Aggregate[Any]]) -> None:
        if aggregate_type not in self._registered:
            register_events(self.store.registry, aggregate_type.event_types())
            self._registered.add(aggregate_type)

    # -- loading --------------------------------------------------------------

    async def get(self, aggregate_id: str | UUID, *, version: int | None = None) -> A:
        """The aggregate with all its stored events applied, or as it was after event ``version``.

        Raises :class:`AggregateNotFoundError` when it has no events (or fewer
        than ``version``) and :class:`InvalidAggregateIdError` for an id that
        cannot name a stream; ``version`` must be None or an int >= 1 (versions
        count events from 1), else :class:`~eventstore.InvalidArgumentError`.
        An aggregate whose stored history has a hole (a commit deleted or
        purged, a forged commit), before or after its snapshot or cached copy,
        raises :class:`~eventstore.HistoryGapError`: it is never built on part
        of its events. The returned object is yours: changing it changes nothing stored until
        you save it. An id is a ``str`` or a :class:`uuid.UUID` (stored as its
        canonical text, so both name the same aggregate).
        """
        aggregate_id = str(aggregate_id) if isinstance(aggregate_id, UUID) else aggregate_id
        self.aggregate_type._stream_id(aggregate_id)
        if version is not None:
            return await self._load_at(aggregate_id, check_int("version", version, 1))
        cached = self._cache_get(aggregate_id)
        if cached is not None:
            aggregate = cached._copy()
            if await self._fast_forward(aggregate):
                self._cache_put(aggregate._copy())
            return aggregate
        aggregate = await self._load(aggregate_id)
        if aggregate.version == 0:
            raise AggregateNotFoundError(self.aggregate_type.__name__, aggregate_id)
        self._cache_put(aggregate._copy())
        return aggregate

    async def _load(self, aggregate_id: str, *, consistent: bool = False) -> A:
        """Replay from the store: the latest usable snapshot and the events after it, or every event.

        ``consistent``: read up to the entity's last commit as the stream's leader knows it (before a command
        retried after a conflict; a replica that answers a plain read may lag on a cluster).
        """
        aggregate = self.aggregate_type(aggregate_id)
        snapshots = self._snapshots
        if snapshots is not None:
            snapshot = await snapshots.get(aggregate_id)
            tail = (
                await self._events_after(aggregate.stream_id, snapshot, consistent=consistent)
                if snapshot is not None
                else None
            )
            if snapshot is not None and tail is not None:
                aggregate.state, aggregate.version, aggregate.position = snapshot.state, snapshot.version, snapshot.position
                aggregate.commands = dict(snapshot.commands)
                aggregate._replay(tail)
                self.store.remember(aggregate.stream_id, aggregate.version, aggregate.position)
                if len(tail) >= snapshots.every:
                    await snapshots.put(aggregate_id, aggregate.version, aggregate.position, aggregate.state, aggregate.commands)
                return aggregate
        aggregate._replay(await self.store.read(aggregate.stream_id, consistent=consistent))
        if snapshots is not None and aggregate.version >= snapshots.every:
            # No usable snapshot, yet enough events for one: write it so the next load is short.
            await snapshots.put(aggregate_id, aggregate.version, aggregate.position, aggregate.state, aggregate.commands)
        return aggregate

    async def _load_at(self, aggregate_id: str, version: int) -> A:
        aggregate = self.aggregate_type(aggregate_id)
        snapshot = await self._snapshots.get(aggregate_id) if self._snapshots is not None else None
        tail = None
        if snapshot is not None and snapshot.version <= version:
            tail = await self._events_after(aggregate.stream_id, snapshot, to_version=version)
        if snapshot is not None and tail is not None:
            aggregate.state, aggregate.version, aggregate.position = snapshot.state, snapshot.version, snapshot.position
            aggregate.commands = dict(snapshot.commands)
            aggregate._replay(tail)
        else:
            aggregate._replay(await self.store.read(aggregate.stream_id, to_version=version))
        if aggregate.version == 0:
            raise AggregateNotFoundError(self.aggregate_type.__name__, aggregate_id)
        if aggregate.version < version:
            raise AggregateNotFoundError(self.aggregate_type.__name__, aggregate_id, version, aggregate.version)
        # Event `version` may sit mid-commit, so its position does not prove the aggregate is current:
        # saving it must let the store check the version itself.
        aggregate._historic = True
        return aggregate

    async def _events_after(
        self, stream_id: StreamId, snapshot: Snapshot[Any], to_version: int | None = None, consistent: bool = False
    ) -> list[RecordedEvent] | None:
        """The events after the snapshot, or None when the snapshot does not line up with the stream.

        The read starts at the snapshot's own commit, whose last version must be
        the snapshot's: this catches a snapshot that outlived its stream (a
        stream deleted and created again) even when no event follows it.
        """
        events = await self.store.read(
            stream_id, from_position=snapshot.position, to_version=to_version, consistent=consistent
        )
        boundary = 0
        while boundary < len(events) and events[boundary].position == snapshot.position:
            boundary += 1
        if boundary and events[boundary - 1].version == snapshot.version:
            return events[boundary:]
        log.warning(
            "The snapshot of %s at version %d does not line up with its events; replaying all events.",
            stream_id, snapshot.version,
        )
        return None

    async def _fast_forward(self, aggregate: A, *, consistent: bool = False) -> bool:
        """Apply the events stored after the aggregate's position (``consistent``: as the stream's leader knows
        them); True if there were any."""
        events = await self.store.read(
            aggregate.stream_id, from_version=aggregate.version + 1, from_position=aggregate.position + 1,
            consistent=consistent,
        )
        aggregate._replay(events)
        return bool(events)

    # -- saving ---------------------------------------------------------------

    def _append_request(self, aggregate: Aggregate[Any]) -> tuple[EntityAppend, int]:
        self._register(type(aggregate))
        before = aggregate.version - len(aggregate._pending)
        if before == 0:
            request = EntityAppend(aggregate.stream_id, list(aggregate._pending), NO_STREAM)
        else:
            position = None if aggregate._historic else aggregate.position
            request = EntityAppend(aggregate.stream_id, list(aggregate._pending), before, position)
        return request, before

    async def save(self, aggregate: A, *, correlation_id: str | None = None, causation_id: str | None = None) -> None:
        """Store the aggregate's pending events in one atomic commit, if it is still at the version it was loaded at.

        On success the pending events are cleared and ``position`` is the
        commit's position. Raises :class:`~eventstore.ConcurrencyError` when
        someone else saved first (nothing stored; the aggregate keeps its
        pending events: load it again and rerun the command). Saving an
        aggregate without pending events does nothing.
        """
        await self.save_all([aggregate], correlation_id=correlation_id, causation_id=causation_id)

    async def save_all(
        self,
        aggregates: Iterable[Aggregate[Any]],
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> None:
        """Save several aggregates (of any types) in one atomic commit: all are stored, or none is.

        A conflict on any of them raises :class:`~eventstore.ConcurrencyError`
        and stores nothing for any of them.
        """
        dirty = [a for a in aggregates if a._pending]
        if not dirty:
            return
        requests = [self._append_request(a) for a in dirty]
        results = await self.store.append_many(
            [request for request, _ in requests], correlation_id=correlation_id, causation_id=causation_id
        )
        for aggregate, (_, before), result in zip(dirty, requests, results):
            aggregate._committed(result.last_version, result.position)
            if isinstance(aggregate, self.aggregate_type):
                self._cache_put(aggregate._copy())
                await self._maybe_snapshot(aggregate, before)

    async def _maybe_snapshot(self, aggregate: A, before: int) -> None:
        if self._snapshots is not None and self._snapshots.due(before, aggregate.version):
            await self._snapshots.put(
                aggregate.id, aggregate.version, aggregate.position, aggregate.state, aggregate.commands
            )

    # -- commands -------------------------------------------------------------

    @overload
    async def execute(  # a coroutine function: its result is awaited
        self,
        aggregate_id: str | UUID,
        command: Callable[[A], Awaitable[R]],
        *,
        create: bool = False,
        exist_ok: bool = False,
        command_id: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: Callable[[R], str | None] | None = None,
    ) -> CommandResult[R]: ...

    @overload
    async def execute(
        self,
        aggregate_id: str | UUID,
        command: Callable[[A], R],
        *,
        create: bool = False,
        exist_ok: bool = False,
        command_id: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: Callable[[R], str | None] | None = None,
    ) -> CommandResult[R]: ...

    async def execute(
        self,
        aggregate_id: str | UUID,
        command: Callable[[A], Any],
        *,
        create: bool = False,
        exist_ok: bool = False,
        command_id: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: Callable[[Any], str | None] | None = None,
    ) -> CommandResult[Any]:
        """Load the aggregate, run ``command`` on it, save what it recorded; retry on conflicts.

        * On :class:`~eventstore.ConcurrencyError` the aggregate is brought up
          to date and the command runs again, at most ``retry.attempts`` saves,
          with jittered backoff; then the last ConcurrencyError is raised.
        * An exception from the command (e.g. a :class:`DomainError`) stores
          nothing and is raised, never retried. A refusal (or a command that
          records nothing) is reported only after the command ran on state
          read from the store, never on a possibly stale cached copy.
        * ``create=True`` runs the command on a new, empty aggregate, and
          raises :class:`AggregateExistsError` (storing nothing) when the id
          has events already; ``exist_ok=True`` with it runs the command on
          the aggregate as it is instead (create or update). Without
          ``create`` a missing aggregate raises :class:`AggregateNotFoundError`.
        * ``command_id`` makes the command idempotent on this aggregate, at any
          age: running it again with the same id does not run the command,
          stores nothing and returns the first run's version and position
          with ``duplicate=True``. The id is stored with the commit (the
          append's idempotency key), so every load (replay, snapshot or
          cache) knows the ids applied to the aggregate (``commands``); a
          rerun racing the first run is caught by the server's concurrency
          check and deduplication. Ids compare exactly; use one per command.
        * ``note``, a function, is called with the command's value before its
          events are stored (after every run that records events); the text
          it returns (None: none) is stored with the commit, as the append's
          note (see :meth:`EventStore.append <eventstore.EventStore.append>`),
          and returned as ``note``. A rerun of the command id returns the note
          its first run stored, so a resend learns what the first caller
          learnt (a command service sends the handler's value this way). An
          exception from it is the command's: nothing is stored.
        * ``correlation_id`` and ``causation_id`` are stored with every event;
          ``causation_id`` defaults to ``command_id`` when a header can carry
          it unchanged (see :func:`eventstore.wire.check_metadata`).

        ``aggregate_id`` is a ``str`` or a :class:`uuid.UUID`, as for :meth:`get`.
        ``command`` may be a plain function or a coroutine function; its
        return value is returned as ``value``. Arguments are checked before
        anything is loaded: an id that cannot name a stream raises
        :class:`InvalidAggregateIdError`; a ``command`` that is not callable or
        a ``create`` or ``exist_ok`` that is not a bool, or ``exist_ok``
        without ``create``, raises :class:`~eventstore.InvalidArgumentError`.
        """
        aggregate_id = str(aggregate_id) if isinstance(aggregate_id, UUID) else aggregate_id
        if not isinstance(aggregate_id, str):  # the cache lookup below must not meet an unhashable id
            self.aggregate_type._stream_id(aggregate_id)
        if not callable(command):
            raise InvalidArgumentError(
                f"Invalid command: {command!r:.80} is not callable; pass a function taking the aggregate."
            )
        check_bool("create", create)
        check_bool("exist_ok", exist_ok)
        if exist_ok and not create:
            raise InvalidArgumentError("exist_ok=True applies to a creating command: pass create=True with it.")
        cached = self._cache.get(aggregate_id)
        stream_id = cached.stream_id if cached is not None else self.aggregate_type._stream_id(aggregate_id)
        if command_id is not None and (not isinstance(command_id, str) or not command_id):
            raise InvalidArgumentError(f"command_id must be a non-empty str or None, not {command_id!r}; nothing ran.")
        if causation_id is None and command_id is not None and _carried_as_header(command_id):
            causation_id = command_id
        if note is not None and not callable(note):
            raise InvalidArgumentError(f"note must be a function of the command's value or None, not {note!r:.80}.")
        lock = self._locks.get(aggregate_id)
        if lock is None:
            lock = self._locks[aggregate_id] = _CountedLock()
        lock.users += 1
        try:
            # Commands on one aggregate in this process take turns instead of racing to conflicts.
            async with lock:
                return await self._execute(
                    stream_id, aggregate_id, command, create, exist_ok, command_id, correlation_id, causation_id, note
                )
        finally:
            lock.users -= 1
            if not lock.users:
                del self._locks[aggregate_id]

    async def _execute(
        self,
        stream_id: StreamId,
        aggregate_id: str,
        command: Callable[[A], R | Awaitable[R]],
        create: bool,
        exist_ok: bool,
        command_id: str | None,
        correlation_id: str | None,
        causation_id: str | None,
        note: Callable[[R], str | None] | None,
    ) -> CommandResult[R]:
        conflicts = 0
        refresh = False
        next_copy: tuple[A, bool] | None = None
        counted = False  # the cache's part is counted once per command, by its first copy's fate
        while True:
            first = next_copy is None and not refresh
            aggregate, checked = next_copy or await self._checkout(aggregate_id, create=create, refresh=refresh)
            next_copy = None
            if first and checked:
                counted = self._count_cache("miss")
            if command_id is not None and command_id in aggregate.commands:
                # Applied before (even a stale copy's history is true): the first run's result, at any age.
                version, position = aggregate.commands[command_id]
                stored_note = None
                if note is not None:  # read from the first run's commit, which holds the id (one read from it)
                    found = await self.store.find_append(stream_id, command_id, from_position=position)
                    stored_note = found.note if found is not None else None
                return CommandResult(None, version, position, True, stored_note)
            if create and not exist_ok and aggregate.version > 0:
                # (Even a stale copy is proof: an aggregate's version never goes back.) A creation that lost a race
                # to another writer conflicts below, and meets this check on its retry.
                raise AggregateExistsError(self.aggregate_type.__name__, aggregate_id, aggregate.version)
            ran_at = aggregate.version
            value: R | None = None
            error: Exception | None = None
            try:
                outcome = command(aggregate)
                value = cast(R, await outcome if inspect.isawaitable(outcome) else outcome)
            except Exception as exc:
                error = exc
            if error is not None or not aggregate._pending:
                if not checked:
                    # A refusal or a no-op must not rest on a stale cached copy: rerun if the store moved on.
                    fresh = await self._checkout(aggregate_id, create=create, refresh=True)
                    if fresh[0].version != ran_at:
                        counted = counted or self._count_cache("stale")
                        next_copy = fresh
                        continue
                counted = counted or self._count_cache("hit")
                if error is not None:
                    raise error
                return CommandResult(value, aggregate.version, aggregate.position)
            request, before = self._append_request(aggregate)
            text = note(cast(R, value)) if note is not None else None
            try:
                result = await self.store.append(
                    stream_id,
                    request.events,
                    request.expected_version,
                    expected_position=request.expected_position,
                    idempotency_key=command_id,
                    correlation_id=correlation_id,
                    causation_id=causation_id,
                    note=text,
                )
            except ConcurrencyError:
                counted = counted or self._count_cache("stale")
                conflicts += 1
                if conflicts >= self.retry.attempts:
                    raise
                await asyncio.sleep(self.retry.delay_s(conflicts - 1))
                refresh = True
                continue
            counted = counted or self._count_cache("hit")
            if result.duplicate:  # the event store reports the first write's versions and note
                return CommandResult(None, result.last_version, result.position, True, result.note)
            aggregate._committed(result.last_version, result.position, command_id)
            self._cache_put(aggregate)  # no copy: nothing else holds this object
            await self._maybe_snapshot(aggregate, before)
            return CommandResult(value, aggregate.version, aggregate.position, note=text)

    async def _checkout(self, aggregate_id: str, *, create: bool, refresh: bool) -> tuple[A, bool]:
        """A private copy to run a command on, and whether it was just checked against the store."""
        cached = self._cache_get(aggregate_id)
        if cached is not None:
            aggregate = cached._copy()
            if not refresh:
                return aggregate, False
            if await self._fast_forward(aggregate, consistent=True):
                self._cache_put(aggregate._copy())
            return aggregate, True
        aggregate = await self._load(aggregate_id, consistent=refresh)
        if aggregate.version == 0:
            if not create:
                raise AggregateNotFoundError(self.aggregate_type.__name__, aggregate_id)
            return aggregate, True
        self._cache_put(aggregate._copy())
        return aggregate, True

    # -- cache ----------------------------------------------------------------

    def _count_cache(self, outcome: str) -> bool:
        """Count one command's cache outcome ("hit", "stale" or "miss"); True, for the caller's ``counted``."""
        setattr(self.cache_stats, _CACHE_FIELDS[outcome], getattr(self.cache_stats, _CACHE_FIELDS[outcome]) + 1)
        labelled(AGGREGATE_CACHE, self.aggregate_type.category, outcome).inc()
        return True

    def _cache_get(self, aggregate_id: str) -> A | None:
        aggregate = self._cache.get(aggregate_id)
        if aggregate is not None:
            self._cache.move_to_end(aggregate_id)
        return aggregate

    def _cache_put(self, aggregate: A) -> None:
        if self.cache_size <= 0:
            return
        known = self._cache.get(aggregate.id)
        if known is not None and known.version >= aggregate.version:
            return
        self._cache[aggregate.id] = aggregate
        self._cache.move_to_end(aggregate.id)
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)


def _carried_as_header(text: str) -> bool:
    try:
        check_metadata("causation_id", text)
    except InvalidArgumentError:
        return False
    return True

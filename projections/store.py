"""The read-model store interface: what the daemon and rebuilds need from a backend.

A store keeps, for every projection, *generations* of its tables: the live
one (what readers see) and at most one being built by a rebuild. Each
generation has its own checkpoint, stored in the same backend transaction as
the rows it covers. :class:`~projections.sqlite.SqliteStore` is the embedded
default; a PostgreSQL store implements the same two classes (schemas or
suffixed tables per generation, views or ``search_path`` for readers) and
passes the same contract tests, with no change to projection code.

Exactly-once effects rest on one rule every backend must keep:
:meth:`WriteTransaction.commit` stores the rows *and* moves the checkpoint
from the value the writer last saw to the new one, atomically, and only if
the stored checkpoint and owner are still the writer's; otherwise it stores
nothing and raises :class:`~projections.errors.CheckpointConflictError`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from .tables import Key, Row
from .transaction import BufferedTransaction

if TYPE_CHECKING:
    from .projection import Projection

T = TypeVar("T")

__all__ = [
    "DeadLetter",
    "Generation",
    "GenerationState",
    "ReadModelStore",
    "RunState",
    "StoredStatus",
    "WriteTransaction",
    "Writer",
]


class GenerationState(str, Enum):
    """Where a generation of a projection's tables is in its life."""

    LIVE = "live"
    """What readers see; the daemon keeps it up to date."""
    BUILDING = "building"
    """Being filled by a rebuild; invisible to readers until the switch."""
    RETIRED = "retired"
    """Replaced by a rebuilt generation: no writer commits to it any more; its tables are dropped."""


class RunState(str, Enum):
    """What the daemon last said about a projection (see :mod:`projections.status` for staleness)."""

    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation of a projection's tables, as stored."""

    projection: str
    generation: int
    version: int
    state: GenerationState
    checkpoint: int
    definition: dict[str, Any]
    stream: str
    owner: str | None
    target: int | None
    created_at: float
    heartbeat_at: float | None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A commit the projection could not apply and skipped on purpose (``dead_letter`` policy)."""

    projection: str
    generation: int
    position: int
    index: int
    stream_id: str
    event_type: str
    event_id: str
    error: str
    traceback: str
    recorded_at: str
    dead_at: float


@dataclass(frozen=True, slots=True)
class StoredStatus:
    """A projection's stored state: its live and building generations and the daemon's last word."""

    projection: str
    state: RunState
    owner: str | None
    updated_at: float
    live: Generation | None
    building: Generation | None
    counters: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    dead_letters: int = 0


class WriteTransaction(BufferedTransaction):
    """A handler transaction that commits together with the checkpoint."""

    @abstractmethod
    def commit(self, checkpoint: int) -> None:
        """Store the writes, the dead letters and ``checkpoint`` atomically (see the module docs)."""

    @abstractmethod
    def rollback(self) -> None:
        """Forget the writes; the stored read model and checkpoint are unchanged."""

    @abstractmethod
    def dead_letter(self, letter: DeadLetter) -> None:
        """Record ``letter``; stored by :meth:`commit`, with the checkpoint that moves past it."""


class Writer(ABC):
    """The single writer of one generation, for one owner. Not safe for concurrent use."""

    generation: Generation
    owner: str
    checkpoint: int
    """The checkpoint this writer last committed (or found)."""
    transient_errors: tuple[type[Exception], ...] = ()
    """Its store's :attr:`ReadModelStore.transient_errors`: raised through handlers, never blamed on an event."""

    @abstractmethod
    def transaction(self) -> WriteTransaction:
        """Begin a transaction (one at a time)."""

    @abstractmethod
    def touch(self, counters: dict[str, Any] | None = None) -> bool:
        """Record a heartbeat (and counters); False when this writer no longer owns the generation."""

    @abstractmethod
    def close(self) -> None:
        """Forget cached rows."""


class ReadModelStore(ABC):
    """Generations, checkpoints, run states and dead letters of the projections in one database."""

    store_id: str
    """A stable id of this database: leases are taken per (store, projection)."""

    transient_errors: tuple[type[Exception], ...] = ()
    """The store's errors that a retry of the same batch may overcome (a busy database, a lost connection)."""

    _worker: "_StoreThread | None" = None

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` -- a call on this store, its writers or their transactions -- run in the store's own
        thread, after every call offloaded before it: async code never waits on the database in the event loop.

        A cancelled caller stops waiting, and a call that has started is interrupted (:meth:`interrupt`: a
        batch cut short is rolled back whole); the next call never overlaps it. The thread is a daemon
        thread: a call stuck on a frozen server never keeps the process from exiting.
        """
        worker = self._worker
        if worker is None:
            worker = self._worker = _StoreThread()
        future = worker.submit(partial(fn, *args))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.running():
                self.interrupt()
            raise

    async def aclose(self) -> None:
        """:meth:`close`, after every offloaded call; it happens even when the caller is cancelled meanwhile."""
        worker, self._worker = self._worker, None
        if worker is None:
            self.close()
            return
        closed = worker.submit(self.close)
        worker.finish()
        await asyncio.wrap_future(closed)

    def interrupt(self) -> None:
        """Make the database call in flight, if any, fail soon (callable from any thread); nothing by default."""

    @abstractmethod
    def ensure_live(self, projection: "Projection", stream: str) -> Generation:
        """The projection's live generation, created empty (checkpoint 0) on first use."""

    @abstractmethod
    def live_generation(self, name: str) -> Generation | None:
        """The live generation of projection ``name``, or None before its first use."""

    @abstractmethod
    def claim(self, name: str, owner: str) -> Generation:
        """Make ``owner`` the writer of the live generation (the caller holds the lease); set state running."""

    @abstractmethod
    def create_shadow(self, projection: "Projection", stream: str, owner: str, target: int) -> Generation:
        """A new, empty generation in state building, owned by ``owner``; leftovers of failed rebuilds are dropped."""

    @abstractmethod
    def resume_shadow(self, projection: "Projection", stream: str, owner: str, target: int) -> Generation | None:
        """Hand an interrupted rebuild's generation to ``owner``, to go on from its checkpoint; None if there is none.

        Only a generation in state building, of the same projection version,
        definition and stream, qualifies; the caller holds the rebuild lease,
        so its former builder is gone.
        """

    @abstractmethod
    def release_shadow(self, shadow: Generation, owner: str) -> None:
        """Leave ``owner``'s interrupted generation in state building, ownerless, for :meth:`resume_shadow`."""

    @abstractmethod
    def switch(self, shadow: Generation) -> bool:
        """Atomically make ``shadow`` the live generation if its checkpoint has reached the live one's.

        Returns False (changing nothing) when the live generation is further
        ahead: catch up and try again. The old generation is retired: its
        writer's next batch raises :class:`~projections.errors.CheckpointConflictError`
        and writes nothing, whatever it was doing at the switch (never a
        database error, even once the old tables are dropped).
        """

    @abstractmethod
    def discard(self, name: str, generation: int, owner: str | None = None) -> None:
        """Drop a generation that is not live; given ``owner``, only while that owner (or nobody) holds it, so a
        rebuild that gives up never drops a shadow another rebuild has resumed since."""

    @abstractmethod
    def writer(self, generation: Generation, owner: str) -> Writer:
        """The writer of ``generation`` (which ``owner`` must own)."""

    @abstractmethod
    def set_state(
        self,
        name: str,
        state: RunState,
        *,
        owner: str | None,
        counters: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        """Record the daemon's state for ``name`` (only while ``owner`` is the recorded owner, if one is)."""

    @abstractmethod
    def statuses(self) -> list[StoredStatus]:
        """Every projection's stored state."""

    @abstractmethod
    def dead_letters(self, name: str) -> list[DeadLetter]:
        """The dead letters of the live generation of ``name``, by position."""

    @abstractmethod
    def drop_dead_letters(self, name: str, position: int | None) -> int:
        """Forget the live generation's dead letters of ``name`` at ``position`` (every one when None), as
        handled by hand; returns how many there were. The read model and its checkpoint are unchanged."""

    @abstractmethod
    def get(self, table: str, key: Key) -> Row | None:
        """The row with ``key`` of the live read-model table ``table`` (as readers see it), or None.

        ``key`` is the key column's value, or a tuple of the key columns' values.
        """

    @abstractmethod
    def rows(self, table: str, where: Mapping[str, Any] | None = None) -> list[Row]:
        """The rows of the live read-model table ``table`` whose columns equal ``where``'s values, sorted by key."""

    @abstractmethod
    def dump(self, name: str) -> dict[str, list[Row]]:
        """Every row of every table of the live generation, as readers see them, sorted by key."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection."""

    def __enter__(self) -> "ReadModelStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StoreThread:
    """One daemon thread running a store's calls in the order they were submitted."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="jetsourcing-store", daemon=True).start()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        future: Future[T] = Future()
        self._calls.put((future, fn))
        return future

    def finish(self) -> None:
        """End the thread once the calls submitted so far have run."""
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue  # its caller stopped waiting before it started
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, as an executor does
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, item

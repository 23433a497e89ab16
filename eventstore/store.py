"""The event store: one object to append, read, subscribe and inspect.

Example::

    from pydantic import BaseModel
    from eventstore import EventStore, StreamId, NO_STREAM

    class Deposited(BaseModel):
        amount: int

    async with EventStore.connect() as store:          # embedded nats-server unless NATS_URL is set
        store.registry.register(Deposited)
        account = StreamId("Account", "alice@example.com")
        await store.append(account, [Deposited(amount=10)], expected_version=NO_STREAM)
        events = await store.read(account)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Generator, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoServersError
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from pydantic import BaseModel

from . import security
from .append import Appender, EntityAppend
from .connection import connect as connect_nats
from .errors import AuthenticationError, ServerUnavailableError, StreamConfigError
from .events import ANY, AppendResult, ExpectedVersion, RecordedEvent, StreamState
from .inbox import Inbox
from .reading import Reader
from .registry import TypeRegistry
from .server import EmbeddedServer
from .settings import EventStoreSettings
from .streams import StreamId, decode_entity_id, validate_category
from .tasks import Outage
from .wire import Header

__all__ = ["EntityInfo", "EventStore", "StoreInfo"]

log = logging.getLogger("jetsourcing.eventstore")


class _ConnectionLog:
    """A connection's trouble, logged once per outage (and a reminder a minute), not per reconnect attempt.

    nats-py's default logs a full traceback for every failed attempt, five a second while the server is down.
    """

    def __init__(self) -> None:
        self.outage = Outage("NATS connection", log)

    async def error(self, exc: Exception) -> None:
        self.outage.failed(exc)

    async def reconnected(self) -> None:
        self.outage.succeeded()
        log.info("Reconnected to NATS")


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """The stream's state: its last position and how many commits it holds."""

    stream: str
    last_position: int
    first_position: int
    commits: int
    bytes: int


@dataclass(frozen=True, slots=True)
class Pending:
    """The commits after a position that a reader has not seen yet: how many, and the oldest of them."""

    commits: int
    first_position: int | None
    first_recorded_at: datetime | None

    def age_s(self) -> float:
        """Seconds since the oldest pending commit was recorded (0 when nothing is pending)."""
        if self.first_recorded_at is None:
            return 0.0
        return max(0.0, (datetime.now(self.first_recorded_at.tzinfo) - self.first_recorded_at).total_seconds())


@dataclass(frozen=True, slots=True)
class EntityInfo:
    """One entity of a category: its current version (= its event count) and its commit count."""

    stream_id: StreamId
    version: int
    commits: int


class EventStore:
    """An event store in one JetStream stream. Safe for many concurrent tasks on one event loop.

    Create it with :meth:`connect` (which also starts an embedded server when
    no URL is configured and creates the stream) or from an existing nats-py
    connection with the constructor plus :meth:`ensure_stream`.
    """

    def __init__(
        self,
        nc: NATS,
        settings: EventStoreSettings | None = None,
        registry: TypeRegistry | None = None,
        *,
        server: EmbeddedServer | None = None,
    ) -> None:
        self.nc = nc
        self.settings = settings or EventStoreSettings()
        self.registry = registry or TypeRegistry()
        self.server = server
        self._inbox = Inbox(nc)
        self._appender = Appender(nc, self._inbox, self.settings, self.registry)
        self._reader = Reader(nc, self._appender, self.settings, self.registry)

    # -- lifecycle ----------------------------------------------------------

    @classmethod
    def connect(
        cls,
        settings: EventStoreSettings | None = None,
        registry: TypeRegistry | None = None,
        *,
        create_stream: bool = True,
        **connect_options: Any,
    ) -> "_Connecting":
        """Connect to ``settings.nats_url`` (or start an embedded server) and make sure the stream exists.

        Use it as ``store = await EventStore.connect()`` or ``async with
        EventStore.connect() as store:``. The connection reconnects forever
        after a lost connection or a server restart. Extra keyword arguments go
        to :func:`nats.connect`.
        """
        return _Connecting(cls._connect(settings, registry, create_stream, connect_options))

    @classmethod
    async def _connect(
        cls,
        settings: EventStoreSettings | None,
        registry: TypeRegistry | None,
        create_stream: bool,
        connect_options: dict[str, Any],
    ) -> "EventStore":
        settings = settings or EventStoreSettings()
        server = None
        url = settings.nats_url
        if url is None:
            server = EmbeddedServer(settings.storage_dir, sync_always=settings.sync_always).start()
            url = server.url
        closing: list[NATS] = []

        async def on_disconnected() -> None:
            if not (closing and closing[0].is_closed):
                log.warning("Disconnected from NATS; reconnecting")

        # Give up on the first connection after about request_timeout_s; once
        # connected, reconnect forever (see below).
        first_attempts = max(1, int(settings.request_timeout_s / 0.2))
        connection_log = _ConnectionLog()
        options: dict[str, Any] = {
            "name": settings.connect_name,
            "max_reconnect_attempts": first_attempts,
            "reconnect_time_wait": 0.2,
            "connect_timeout": settings.request_timeout_s,
            "allow_reconnect": True,
            "error_cb": connection_log.error,
            "disconnected_cb": on_disconnected,
            "reconnected_cb": connection_log.reconnected,
            **security.connect_options(settings),
        }
        options.update(connect_options)
        try:
            nc = await connect_nats(url.split(","), **options)
        except (NoServersError, OSError, asyncio.TimeoutError, NatsError) as exc:
            if server:
                server.close()
            if isinstance(exc, AuthenticationError):
                raise  # already says what to fix
            raise ServerUnavailableError(
                f"Could not connect to NATS at {security.redact_url(url)}: {exc or type(exc).__name__}. "
                "Start a server, or fix NATS_URL."
            ) from exc
        closing.append(nc)
        if "max_reconnect_attempts" not in connect_options:
            nc.options["max_reconnect_attempts"] = -1
        store = cls(nc, settings, registry, server=server)
        if create_stream:
            await store.ensure_stream()
        return store

    async def close(self) -> None:
        """Close the connection (and stop the embedded server, if this store started one)."""
        await self._inbox.close()
        if not self.nc.is_closed:
            try:
                if self.nc.is_connected:
                    await self.nc.drain()
            except (NatsError, asyncio.TimeoutError, OSError):
                pass  # a connection that is down or reconnecting has nothing to drain
            finally:
                with contextlib.suppress(NatsError, asyncio.TimeoutError, OSError):
                    await self.nc.close()
        if self.server is not None:
            self.server.close()

    async def __aenter__(self) -> "EventStore":
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- the stream ---------------------------------------------------------

    def stream_config(self) -> StreamConfig:
        """The stream settings an event store needs (see the README's 'Stream layout')."""
        s = self.settings
        limited = any(v is not None for v in (s.max_age_s, s.max_msgs, s.max_bytes))
        return StreamConfig(
            name=s.stream,
            subjects=[f"{s.subject_prefix}.>"],
            storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.NEW if limited else DiscardPolicy.OLD,
            max_age=s.max_age_s,
            max_msgs=s.max_msgs or -1,
            max_bytes=s.max_bytes or -1,
            duplicate_window=s.duplicate_window_s,
            num_replicas=s.replicas,
            deny_delete=True,
            deny_purge=True,
            allow_direct=True,
            allow_atomic=True,
        )

    async def ensure_stream(self) -> None:
        """Create the stream if it does not exist; check it if it does. Never changes an existing stream."""
        js = self.nc.jetstream(timeout=self.settings.request_timeout_s)
        wanted = self.stream_config()
        try:
            info = await js.stream_info(self.settings.stream)
        except NotFoundError:
            try:
                await js.add_stream(wanted)
                return
            except NatsError as exc:
                raise StreamConfigError(f"Could not create stream {self.settings.stream!r}: {exc}") from exc
        except (NatsError, asyncio.TimeoutError) as exc:
            raise ServerUnavailableError(
                f"Could not read stream {self.settings.stream!r}: {exc}. Is JetStream enabled on the server (-js)?"
            ) from exc
        have = info.config
        problems = []
        if wanted.subjects and wanted.subjects[0] not in (have.subjects or []):
            problems.append(f"subjects {have.subjects} do not include {wanted.subjects[0]!r}")
        if have.storage != StorageType.FILE:
            problems.append("storage is not file")
        if have.retention not in (None, RetentionPolicy.LIMITS):
            problems.append(f"retention is {have.retention}, which deletes events once consumed (need limits)")
        if not have.deny_delete or not have.deny_purge:
            problems.append("deletes or purges are allowed (need deny_delete and deny_purge)")
        if not have.allow_direct:
            problems.append("direct get is not allowed (need allow_direct)")
        if not have.allow_atomic:
            problems.append("atomic batch publish is not allowed (need allow_atomic)")
        has_limits = bool(have.max_age) or (have.max_msgs or -1) > 0 or (have.max_bytes or -1) > 0
        if has_limits and have.discard != DiscardPolicy.NEW:
            problems.append("it has limits with discard policy 'old', which silently drops events (need 'new')")
        if problems:
            raise StreamConfigError(
                f"Stream {self.settings.stream!r} exists with settings unfit for an event store: "
                + "; ".join(problems)
                + ". jetsourcing never changes an existing stream: fix it with the nats CLI, or use another "
                "stream name (JETSOURCING_STREAM)."
            )

    # -- writing ------------------------------------------------------------

    async def append(
        self,
        stream_id: StreamId,
        events: Sequence[BaseModel],
        expected_version: ExpectedVersion = ANY,
        *,
        expected_position: int | None = None,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> AppendResult:
        """Append ``events`` to one entity, atomically, if it is at ``expected_version``.

        Raises :class:`ConcurrencyError` (nothing stored) if the entity moved.
        Calling again with the same ``idempotency_key`` stores nothing new and
        returns the first call's result with ``duplicate=True``.
        """
        request = EntityAppend(stream_id, events, expected_version, expected_position)
        results = await self._appender.append(
            [request], idempotency_key=idempotency_key, correlation_id=correlation_id, causation_id=causation_id
        )
        return results[0]

    async def append_many(
        self,
        requests: Sequence[EntityAppend],
        *,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> list[AppendResult]:
        """Append to several entities in one atomic commit: all are stored, or none (e.g. a money transfer).

        Each entity's expected version is checked by the server; a conflict on
        any one rejects the whole append with :class:`ConcurrencyError`.
        """
        return await self._appender.append(
            requests, idempotency_key=idempotency_key, correlation_id=correlation_id, causation_id=causation_id
        )

    async def find_append(self, stream_id: StreamId, idempotency_key: str) -> AppendResult | None:
        """What an earlier append with ``idempotency_key`` stored on ``stream_id`` (``duplicate=True``), or None.

        Searches the entity's commits, so it finds appends of any age (not only
        within the duplicate window).
        """
        return await self._appender.find_append(stream_id, idempotency_key)

    def remember(self, stream_id: StreamId, version: int, position: int) -> None:
        """Tell the store an entity's (version, position), e.g. from a snapshot, to save a lookup on append."""
        self._appender.remember(stream_id, version, position)

    # -- reading ------------------------------------------------------------

    async def read(
        self,
        stream_id: StreamId,
        *,
        from_version: int = 1,
        to_version: int | None = None,
        from_position: int = 1,
        consistent: bool = False,
    ) -> list[RecordedEvent]:
        """One entity's events, in version order (empty if it has none). See :meth:`Reader.read`."""
        return await self._reader.read(
            stream_id, from_version=from_version, to_version=to_version, from_position=from_position, consistent=consistent
        )

    def read_all(
        self,
        *,
        from_position: int = 1,
        to_position: int | None = None,
        categories: Sequence[str] | None = None,
        batch: int = 1000,
    ) -> AsyncIterator[list[RecordedEvent]]:
        """Every event (of ``categories``, or all) in global order, in batches, up to the last position at the start."""
        return self._reader.read_all(
            from_position=from_position, to_position=to_position, categories=categories, batch=batch
        )

    def subscribe(
        self,
        *,
        from_position: int = 1,
        categories: Sequence[str] | None = None,
        batch: int = 1000,
        heartbeat_s: float = 1.0,
    ) -> AsyncIterator[list[RecordedEvent]]:
        """Catch up from ``from_position``, then follow live, in batches; survives server restarts."""
        return self._reader.subscribe(
            from_position=from_position, categories=categories, batch=batch, heartbeat_s=heartbeat_s
        )

    def decode(self, seq: int, msg: Any) -> list[RecordedEvent]:
        """Decode one raw stream message (from your own consumer) into its events."""
        return self._reader.decode(seq, msg)

    def filter_subjects(self, categories: Sequence[str] | None = None) -> list[str]:
        """The NATS subject filters that select ``categories`` (all events when None)."""
        return self._reader.filter_subjects(categories)

    # -- inspecting ---------------------------------------------------------

    async def state(self, stream_id: StreamId) -> StreamState:
        """An entity's current version and the position of its last commit, from the server."""
        return await self._appender.state(stream_id)

    async def version(self, stream_id: StreamId) -> int:
        """An entity's current version (its number of events; 0 if it has none)."""
        return (await self.state(stream_id)).version

    async def last_position(self) -> int:
        """The stream's last position (0 when empty)."""
        return await self._reader.last_position()

    async def info(self) -> StoreInfo:
        """The stream's last position, commit count and size."""
        js = self.nc.jetstream(timeout=self.settings.request_timeout_s)
        state = (await js.stream_info(self.settings.stream)).state
        return StoreInfo(self.settings.stream, state.last_seq, state.first_seq, state.messages, state.bytes)

    async def pending(self, after: int, categories: Sequence[str] | None = None) -> Pending:
        """How many commits of ``categories`` (default: all) lie after position ``after``, and the oldest of them.

        This is a reader's lag, counted by the server: one direct get per
        category finds its oldest pending commit, whose ``Nats-Num-Pending``
        says how many more follow. Commits, not events: a commit of several
        events counts once.
        """
        if after < 0:
            raise ValueError(f"after must be a position (0 or more), not {after}.")
        commits = 0
        firsts: list[tuple[int, str]] = []
        for subject in self.filter_subjects(categories):  # disjoint filters: their counts add up
            for msg in await self._appender.direct_get({"seq": after + 1, "next_by_subj": subject, "batch": 1}):
                headers = msg.headers or {}
                commits += int(headers[Header.NUM_PENDING]) + 1
                firsts.append((int(headers[Header.SEQUENCE]), headers.get(Header.RECORDED_AT, "")))
        if not firsts:
            return Pending(0, None, None)
        position, recorded = min(firsts)
        return Pending(commits, position, datetime.fromisoformat(recorded) if recorded else None)

    async def catalogue(self, category: str, *, offset: int = 0, limit: int = 1000) -> list[EntityInfo]:
        """A page of a category's entities, sorted by id, each with its version (event count) and commit count.

        Built from stream info's per-subject counts (``subjects_filter``) and
        multi-last direct gets: no index of our own, no scan of the events.
        """
        subjects = (await self._subject_counts(f"{validate_category(category)}.*"))[offset : offset + limit]
        versions = await self._last_versions([s for s, _ in subjects])
        prefix_len = len(self.settings.subject_prefix) + len(category) + 2
        return [
            EntityInfo(StreamId(category, decode_entity_id(s[prefix_len:])), versions.get(s, 0), commits)
            for s, commits in subjects
        ]

    async def event_count(self) -> int:
        """How many events the store holds (the sum of every entity's version; one multi-last get per 1,000 entities)."""
        subjects = await self._subject_counts(">")
        return sum((await self._last_versions([s for s, _ in subjects])).values())

    async def _subject_counts(self, pattern: str) -> list[tuple[str, int]]:
        js = self.nc.jetstream(timeout=self.settings.request_timeout_s)
        info = await js.stream_info(self.settings.stream, subjects_filter=f"{self.settings.subject_prefix}.{pattern}")
        return sorted((info.state.subjects or {}).items())

    async def _last_versions(self, subjects: list[str]) -> dict[str, int]:
        versions: dict[str, int] = {}
        # The server answers a multi-last get for at most 1,024 subjects (413 beyond).
        for start in range(0, len(subjects), 1000):
            chunk = subjects[start : start + 1000]
            for msg in await self._appender.direct_get({"multi_last": chunk, "batch": len(chunk)}):
                headers = msg.headers or {}
                versions[headers[Header.SUBJECT]] = int(headers[Header.VERSION])
        return versions


class _Connecting:
    """What :meth:`EventStore.connect` returns: await it, or use it as an async context manager."""

    def __init__(self, coro: Coroutine[Any, Any, EventStore]) -> None:
        self._coro = coro
        self._store: EventStore | None = None

    def __await__(self) -> Generator[Any, None, EventStore]:
        return self._coro.__await__()

    async def __aenter__(self) -> EventStore:
        self._store = await self._coro
        return self._store

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._store is not None:
            await self._store.close()

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
import json
import logging
from collections.abc import AsyncIterator, Collection, Coroutine, Generator, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoServersError
from nats.js.errors import NotFoundError
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from pydantic import BaseModel

from . import nats_options, security
from .append import Appender
from .commit import EntityAppend
from .connection import connect as connect_nats
from .connection import flush
from .dcb_jetstream import JetStreamDcb
from .errors import AuthenticationError, InvalidArgumentError, ServerUnavailableError, StreamConfigError, map_nats_error
from .events import ANY, AppendResult, ExpectedVersion, RecordedEvent, StreamState
from .jetstream.inbox import Inbox
from .jetstream.api import ErrorCode, Subjects
from .jetstream.durable import DurableConsumer
from .jetstream.not_now import ride_out_jetstream
from .jetstream.shared import SharedConnection
from .nats_options import check_tcp_urls, options_of
from .reading import Reader, Replayed, StoredMessage
from .registry import TypeRegistry
from .security import ReplaySecurity
from .server import EmbeddedServer
from .settings import EventStoreSettings
from .stream_check import config_problems
from .streams import StreamId, decode_entity_id, validate_category
from .validation import (
    MAX_BATCH,
    check_bool,
    check_categories,
    check_find_append,
    check_int,
    check_optional_int,
    check_read,
    check_read_all,
    check_remember,
    check_seconds,
    check_stream_id,
)
from .tasks import Outage
from .wire import Header, commit_version

__all__ = ["EntityInfo", "EventStore", "StoreInfo"]

log = logging.getLogger("jetsourcing.eventstore")


"""The most messages one read batch may ask for (a batch is held in memory whole)."""


class _ConnectionLog:
    """A connection's trouble, logged once per outage (a warning, a reminder a minute, a line when it is over).

    nats-py calls ``error_cb`` for every failed attempt (every 200 ms while the
    server is down; its default logs a full traceback each time). Before the
    first connection succeeds nothing is logged at warning level: that attempt
    ends in one :class:`ServerUnavailableError` that says it all. Nor is
    anything logged while the store closes.
    """

    def __init__(self, limit_s: float | None = None) -> None:
        self.connected = False
        self.closing = False
        self.outage = Outage("The NATS connection", log)
        self.limit_s = limit_s
        self.nc: NATS | None = None
        self._give_up: asyncio.TimerHandle | None = None
        self._closing: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()

    async def on_error(self, exc: Exception) -> None:
        if not self.connected or self.closing:
            log.debug("NATS connection problem: %s", exc or type(exc).__name__)
        else:
            self.outage.failed(exc)

    async def on_disconnected(self) -> None:
        if self.connected and not self.closing:
            self.outage.failed("disconnected; reconnecting")
            if self.limit_s is not None and self._give_up is None:
                self._give_up = asyncio.get_running_loop().call_later(self.limit_s, self._close_for_good)

    async def on_reconnected(self) -> None:
        self.outage.succeeded()
        if self._give_up is not None:
            self._give_up.cancel()
            self._give_up = None

    def _close_for_good(self) -> None:
        """The outage limit passed without a reconnect: close, so every user of the connection fails and ends."""
        self._give_up = None
        nc = self.nc
        if nc is None or self.closing or nc.is_connected or nc.is_closed:
            return
        log.error("The NATS connection was lost %.0f s ago, the outage limit (outage_limit_s): closing it; "
                  "what uses it now fails.", self.limit_s)
        self.closing = True
        self.lost.set()
        self._closing = asyncio.ensure_future(self._close(nc))

    async def _close(self, nc: NATS) -> None:
        with contextlib.suppress(NatsError, asyncio.TimeoutError, OSError):
            async with asyncio.timeout(5.0):
                await nc.close()


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
        replay_security: ReplaySecurity | None = None,
    ) -> None:
        self.nc = nc
        self.settings = settings or EventStoreSettings()
        # The replays' own connection must reach the server as nc does: with nc's credentials and TLS (its public
        # options), over TCP. replay_security, when given, says how instead (connect() passes its options'). Raises
        # InvalidArgumentError for what replays could not honour, rather than failing at the first replay.
        connected = nc.connected_url
        check_tcp_urls(self.settings.nats_url or (connected.geturl() if connected is not None and not server else None))
        replay_security = replay_security or nats_options.replay_security(self.settings, options_of(nc))
        self.registry = registry or TypeRegistry()
        self.server = server
        self._inbox = Inbox(nc)
        self._appender = Appender(nc, self._inbox, self.settings, self.registry)
        self._dcb: JetStreamDcb | None = None
        self._replays = SharedConnection(
            self._servers, replay_security, self.settings.request_timeout_s, f"{self.settings.connect_name}-replay",
            ping_interval_s=self.settings.ping_interval_s, max_outstanding_pings=self.settings.max_outstanding_pings,
            inbox_prefix=nc.new_inbox().rpartition(".")[0],  # nc's inbox_prefix: a user may be allowed only that
        )
        self._reader = Reader(nc, self._appender.entities, self.settings, self.registry, self._replays)
        self._connection_log: _ConnectionLog | None = None  # set by connect(), which owns the callbacks
        self._never_lost = asyncio.Event()

    def _servers(self) -> list[str]:
        """Where the bulk-read connection of replays goes: the configured servers, else where ``nc`` is connected."""
        if self.settings.nats_url:
            return [url.strip() for url in self.settings.nats_url.split(",")]
        if self.server is not None:
            return [self.server.url]
        connected = self.nc.connected_url
        return [connected.geturl()] if connected is not None else []

    # -- lifecycle ----------------------------------------------------------

    @classmethod
    def connect(
        cls,
        settings: EventStoreSettings | None = None,
        registry: TypeRegistry | None = None,
        *,
        create_stream: bool = True,
        long_running: bool = False,
        stop: asyncio.Event | None = None,
        **connect_options: Any,
    ) -> "_Connecting":
        """Connect to ``settings.nats_url`` (or start an embedded server) and make sure the stream exists.

        Use it as ``store = await EventStore.connect()`` or ``async with
        EventStore.connect() as store:``. The connection reconnects forever
        after a lost connection or a server restart. ``long_running`` and
        ``stop`` say how long the stream check waits out an election (see
        :meth:`ensure_stream`). Extra keyword arguments go to :func:`nats.connect`; those that carry credentials or
        TLS (``user``, ``password``, ``token``, ``nkeys_seed``, ``user_credentials``, ``tls``, ``tls_hostname``,
        ``tls_handshake_first``) and ``inbox_prefix`` reach the replays' connection too, and the few it could not
        honour (``signature_cb``, ``user_jwt_cb``, ``nkeys_seed_str``, ``servers``) are refused, as are ``ws://``
        URLs, with :class:`~eventstore.InvalidArgumentError` (see :mod:`eventstore.nats_options`).
        """
        return _Connecting(cls._connect(settings, registry, create_stream, connect_options, long_running, stop))

    @classmethod
    async def _connect(
        cls,
        settings: EventStoreSettings | None,
        registry: TypeRegistry | None,
        create_stream: bool,
        connect_options: dict[str, Any],
        long_running: bool = False,
        stop: asyncio.Event | None = None,
    ) -> "EventStore":
        settings = settings or EventStoreSettings()
        # Refused before anything connects: options the replays' connection could not honour, websocket URLs.
        check_tcp_urls(settings.nats_url)
        replays = nats_options.replay_security(settings, connect_options)
        server = None
        url = settings.nats_url
        if url is None:
            server = await EmbeddedServer(settings.storage_dir, sync_always=settings.sync_always).astart()
            url = server.url
            # A script that forgot NATS_URL would otherwise talk, unawares, to a server that no other process
            # knows of and that forgets everything when it ends. A storage_dir says it was meant: info, not warning.
            log.log(
                logging.INFO if settings.storage_dir is not None else logging.WARNING,
                "No NATS_URL set: started an embedded nats-server at %s that lives as long as this process (events "
                "kept %s). Other processes (a command service, the projection daemon) see its events only if given "
                "this URL. For a server they share, run `jetsourcing server` and export the NATS_URL it prints.",
                url, f"in {settings.storage_dir}" if settings.storage_dir is not None else "in a temporary directory",
            )
        connection_log = _ConnectionLog(settings.outage_limit_s)
        # Give up on the first connection after request_timeout_s (a refused connection is retried
        # every 200 ms until then); once connected, reconnect forever (see below).
        first_attempts = max(1, int(settings.request_timeout_s / 0.2))
        servers = url.split(",")
        options: dict[str, Any] = {
            "name": settings.connect_name,
            "max_reconnect_attempts": first_attempts,
            "reconnect_time_wait": 0.2,
            # Each server its share of the deadline: a silent first pick leaves time for the next one.
            "connect_timeout": settings.request_timeout_s / len(servers),
            # A silent server (no reset) is left for another within the same bound as the replays' (see settings).
            "ping_interval": settings.ping_interval_s,
            "max_outstanding_pings": settings.max_outstanding_pings,
            "allow_reconnect": True,
            "drain_timeout": settings.request_timeout_s,
            "error_cb": connection_log.on_error,
            "disconnected_cb": connection_log.on_disconnected,
            "reconnected_cb": connection_log.on_reconnected,
            **security.connect_options(settings),
        }
        options.update(connect_options)
        try:
            nc = await connect_nats(servers, deadline_s=settings.request_timeout_s, **options)
        except (NoServersError, OSError, asyncio.TimeoutError, NatsError) as exc:
            if server:
                await server.aclose()
            if isinstance(exc, AuthenticationError):
                raise  # already says what to fix
            raise ServerUnavailableError(
                f"Could not connect to NATS at {security.redact_url(url)}: {exc or type(exc).__name__}. "
                "Start a server, or fix NATS_URL."
            ) from exc
        connection_log.connected = True
        connection_log.nc = nc
        if "max_reconnect_attempts" not in connect_options:
            nc.reconnect_forever()
        store = cls(nc, settings, registry, server=server, replay_security=replays)
        store._connection_log = connection_log
        if create_stream:
            try:
                await store.ensure_stream(long_running=long_running, stop=stop)
            except BaseException:
                await store.close()  # nothing of a failed connect stays open (nor reconnects forever)
                raise
        return store

    async def close(self) -> None:
        """Close the connection (and stop the embedded server, if this store started one).

        Ends within about twice ``request_timeout_s`` even when the server is
        gone or silent: the connection is drained only after a flush showed
        the server answers within ``request_timeout_s``, then closed.
        """
        if self._connection_log is not None:
            self._connection_log.closing = True
        self._replays.close()
        await self._inbox.close()
        timeout_s = self.settings.request_timeout_s
        if not self.nc.is_closed:
            try:
                if self.nc.is_connected:
                    # nats-py's drain() ignores cancellation and then flushes with a 10 s timeout:
                    # drain only a connection whose server answered a flush in time.
                    await flush(self.nc, timeout_s)
                    await self.nc.drain()
            except (NatsError, asyncio.TimeoutError, OSError):
                pass  # a connection that is down, reconnecting or silent has nothing to drain
            finally:
                with contextlib.suppress(NatsError, asyncio.TimeoutError, OSError):
                    async with asyncio.timeout(timeout_s):
                        await self.nc.close()
        if self.server is not None:
            await self.server.aclose()

    @property
    def connection_lost(self) -> asyncio.Event:
        """Set once the connection was closed for good because an outage outlasted ``outage_limit_s``.

        A long-running user (a command service, a reactor) waits on it beside
        its own stop, and ends with an error when it is set. Never set without
        a limit, nor for a connection the caller made and gave to the store.
        """
        log_ = self._connection_log
        return log_.lost if log_ is not None else self._never_lost

    async def __aenter__(self) -> "EventStore":
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- the stream ---------------------------------------------------------

    def stream_config(self) -> StreamConfig:
        """The stream settings an event store needs (see "Stream layout" in docs/concepts/event-store.md)."""
        s = self.settings
        limited = s.max_msgs is not None or s.max_bytes is not None
        return StreamConfig(
            name=s.stream,
            subjects=[f"{s.subject_prefix}.>"],
            storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.NEW if limited else DiscardPolicy.OLD,
            max_msgs=s.max_msgs or -1,
            max_bytes=s.max_bytes or -1,
            duplicate_window=s.duplicate_window_s,
            num_replicas=s.replicas,
            deny_delete=True,
            deny_purge=True,
            allow_direct=True,
            allow_atomic=True,
        )

    @property
    def dcb(self) -> JetStreamDcb:
        """Dynamic consistency boundaries on this store: reads by query and appends of tagged events under a
        condition the server checks (:class:`~eventstore.dcb_jetstream.JetStreamDcb`, docs/concepts/dcb.md)."""
        if self._dcb is None:
            self._dcb = JetStreamDcb(self)
        return self._dcb

    async def ensure_stream(self, *, long_running: bool = False, stop: asyncio.Event | None = None) -> None:
        """Create the stream if it does not exist, then check it. Never changes an existing stream.

        The check is an allow-list over every setting the server reports
        (:mod:`eventstore.stream_check`, "Stream layout" in docs/concepts/event-store.md): a
        stream under whose settings an acknowledged event could vanish, be
        rewritten or go unacknowledged (an age limit, a per-entity limit,
        rollups, message TTLs, memory storage, ...) is refused with
        :class:`StreamConfigError` naming each such setting and why.

        A server (or JetStream) that does not answer, or answers "not now" (an
        election), raises :class:`ServerUnavailableError` within about
        ``request_timeout_s``; with ``long_running`` (a daemon's or a service's
        start) the check is retried instead, with backoff, for as long as the
        outage policy says (``settings.outage_limit_s``; None: for ever) or
        until ``stop`` is set (see :mod:`eventstore.jetstream.not_now`).
        """
        name, timeout_s = self.settings.stream, self.settings.request_timeout_s
        await ride_out_jetstream(
            self._ensure_stream, what=f"Checking stream {name!r}", logger=log,
            timeout_s=timeout_s, requests=3,  # a read, a create and a read
            limit_s=self.settings.outage_limit_s if long_running else 0.0, stop=stop,
        )

    async def _ensure_stream(self) -> None:
        config = await self._stream_config_json()
        if config is None:
            name = self.settings.stream
            created = await self._inbox.api(
                Subjects(name).stream_create(), json.dumps(self.stream_config().as_dict()).encode(),
                self.settings.request_timeout_s, what=f"Creating stream {name!r}",
            )
            error = created.get("error")
            if error is not None and error.get("err_code") != ErrorCode.STREAM_NAME_IN_USE:  # in use: another client raced us
                raise StreamConfigError(
                    f"Could not create stream {name!r}: {error.get('description')} (err_code {error.get('err_code')})."
                )
            # Check what the server made of it too (it may adjust settings, or another client raced us).
            config = await self._stream_config_json()
            if config is None:
                raise StreamConfigError(f"Stream {self.settings.stream!r} vanished right after it was created.")
        problems = config_problems(config, f"{self.settings.subject_prefix}.>")
        if problems:
            raise StreamConfigError(
                f"Stream {self.settings.stream!r} exists with settings unfit for an event store: "
                + "; ".join(problems)
                + ". jetsourcing never changes an existing stream: fix it with the nats CLI, or use another "
                "stream name (JETSOURCING_STREAM)."
            )

    async def _stream_config_json(self) -> dict[str, Any] | None:
        """The stream's configuration as the server reports it (every setting, also those nats-py does not model).

        None when the stream does not exist.
        """
        name = self.settings.stream
        info = await self._inbox.api(
            Subjects(name).stream_info(), b"", self.settings.request_timeout_s,
            what=f"Reading the settings of stream {name!r}",
        )
        error = info.get("error")
        if error is not None:
            if error.get("err_code") == ErrorCode.STREAM_NOT_FOUND:
                return None
            raise StreamConfigError(f"Could not read the settings of stream {name!r}: {error.get('description')}.")
        config: dict[str, Any] = info["config"]
        return config

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
        note: str | None = None,
    ) -> AppendResult:
        """Append ``events`` to one entity, atomically, if it is at ``expected_version``.

        Every argument is checked before anything is sent (see :class:`EntityAppend`):
        a wrong one raises :class:`InvalidArgumentError` or :class:`InvalidEventError`.
        Raises :class:`ConcurrencyError` (nothing stored) if the entity moved.
        Calling again with the same ``idempotency_key`` stores nothing new and
        returns the first call's result with ``duplicate=True`` (for an ``ANY``
        append, within the duplicate window, or after it only when the entity
        moved on since: see "Idempotency" in docs/concepts/guarantees.md). ``note`` (a short
        text, see :func:`~eventstore.wire.check_note`) is stored with the
        commit and handed back, as ``AppendResult.note``, to such a duplicate
        call and by :meth:`find_append`.
        """
        request = EntityAppend(stream_id, events, expected_version, expected_position)
        results = await self._appender.append(
            [request], idempotency_key=idempotency_key, correlation_id=correlation_id, causation_id=causation_id,
            note=note,
        )
        return results[0]

    async def append_many(
        self,
        requests: Sequence[EntityAppend],
        *,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: str | None = None,
    ) -> list[AppendResult]:
        """Append to several entities in one atomic commit: all are stored, or none (e.g. a money transfer).

        Each entity's expected version is checked by the server; a conflict on
        any one rejects the whole append with :class:`ConcurrencyError`.
        ``note`` is stored with every entity's commit, as for :meth:`append`.
        """
        return await self._appender.append(
            requests, idempotency_key=idempotency_key, correlation_id=correlation_id, causation_id=causation_id,
            note=note,
        )

    async def find_append(
        self, stream_id: StreamId, idempotency_key: str, *, from_position: int = 1
    ) -> AppendResult | None:
        """What an earlier append with ``idempotency_key`` stored on ``stream_id`` at ``from_position`` or later
        (``duplicate=True``, with the ``note`` it stored), or None.

        Searches the entity's commits, so it finds appends of any age (not only
        within the duplicate window); from a known commit's position, in one read.
        """
        check_find_append(stream_id, idempotency_key, from_position)
        return await self._appender.entities.find_append(stream_id, idempotency_key, from_position)

    def remember(self, stream_id: StreamId, version: int, position: int) -> None:
        """Tell the store an entity's (version, position), e.g. from a snapshot, to save a lookup on append.

        Both are ints >= 0, and 0 together (an entity without events); else :class:`InvalidArgumentError`.
        """
        check_remember(stream_id, version, position)
        self._appender.entities.remember(stream_id, version, position)

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
        """One entity's events, in version order (empty if it has none). See :meth:`Reader.read`.

        ``from_version`` >= 1, ``to_version`` None or >= ``from_version``,
        ``from_position`` >= 0 (ints; 0 and 1 both mean from the start),
        ``consistent`` a bool; else :class:`InvalidArgumentError`.
        """
        check_read(stream_id, from_version, to_version, from_position, consistent)
        return await self._reader.read(
            stream_id,
            from_version=from_version,
            to_version=to_version,
            from_position=max(1, from_position),
            consistent=consistent,
        )

    def read_all(
        self,
        *,
        from_position: int = 1,
        to_position: int | None = None,
        categories: Sequence[str] | None = None,
        batch: int = 1000,
    ) -> AsyncIterator[list[RecordedEvent]]:
        """Every event (of ``categories``, or all) in global order, in batches, up to the last position at the start.

        The arguments are checked at the call, before iteration starts:
        positions are ints (``from_position`` >= 1, ``to_position`` None or >= 0),
        ``categories`` None or a list of category names, ``batch`` an int from
        1 to 100,000; else :class:`InvalidArgumentError` (or
        :class:`InvalidStreamIdError` for a bad category name).
        """
        check_read_all(from_position, to_position, categories, batch)
        return self._reader.read_all(
            from_position=from_position, to_position=to_position, categories=categories, batch=batch
        )

    def durable_consumer(self, name: str, *, stream: str | None = None) -> DurableConsumer:
        """The durable consumer ``name`` of ``stream`` (default: the event stream), for code that acknowledges.

        Its JetStream calls are resent while JetStream is between leaders, within
        ``request_timeout_s``; see :class:`~eventstore.jetstream.DurableConsumer`.
        """
        for what, value in (("name", name), ("stream", stream)):
            if value is None and what == "stream":
                continue
            if not isinstance(value, str) or not value or any(c in value for c in " .*>\t\r\n"):
                raise InvalidArgumentError(
                    f"{what} must be a JetStream name (no spaces, '.', '*' or '>'), not {value!r}."
                )
        return DurableConsumer(self.nc, self._inbox, stream or self.settings.stream, name,
                               api_timeout_s=self.settings.request_timeout_s)

    async def consumers(self, *, stream: str | None = None) -> list[dict[str, Any]]:
        """Every consumer of ``stream`` (default: the event stream) as JetStream describes it: ``name``,
        ``config`` (with its ``metadata``), ``num_pending``, ``num_ack_pending``, ``num_redelivered``, ... A
        stream that does not exist raises :class:`StreamConfigError`."""
        name = self._stream_name(stream)
        found: list[dict[str, Any]] = []
        while True:
            page = await self._inbox.api(
                Subjects(name).consumer_list(), json.dumps({"offset": len(found)}).encode(),
                self.settings.request_timeout_s, what=f"Listing the consumers of stream {name!r}",
            )
            if page.get("error"):
                raise StreamConfigError(f"Cannot list the consumers of stream {name!r}: {page['error'].get('description')}.")
            found += page.get("consumers") or []
            if not page.get("consumers") or len(found) >= int(page.get("total") or 0):
                return found

    async def subject_counts(self, subjects_filter: str, *, stream: str | None = None) -> dict[str, int]:
        """How many messages ``stream`` (default: the event stream) holds on each subject matching
        ``subjects_filter`` (wildcards allowed), from stream info: no message is read. A stream that does
        not exist raises :class:`StreamConfigError`."""
        name = self._stream_name(stream)
        if not isinstance(subjects_filter, str) or not subjects_filter or any(c in subjects_filter for c in " \t\r\n"):
            raise InvalidArgumentError(f"subjects_filter must be a NATS subject (wildcards allowed), not {subjects_filter!r}.")
        counts: dict[str, int] = {}
        while True:  # the server answers a page of subjects at a time (``total``, ``offset``, ``limit``)
            info = await self._inbox.api(
                Subjects(name).stream_info(),
                json.dumps({"subjects_filter": subjects_filter, "offset": len(counts)}).encode(),
                self.settings.request_timeout_s, what=f"Counting the messages of stream {name!r}",
            )
            if info.get("error"):
                raise StreamConfigError(f"Cannot read stream {name!r}: {info['error'].get('description')}.")
            page = (info.get("state") or {}).get("subjects") or {}
            before = len(counts)
            counts.update((k, int(v)) for k, v in page.items())
            if len(counts) == before or len(counts) >= int(info.get("total") or 0):
                return counts

    def _stream_name(self, stream: str | None) -> str:
        if stream is None:
            return self.settings.stream
        if not isinstance(stream, str) or not stream or any(c in stream for c in " .*>\t\r\n"):
            raise InvalidArgumentError(f"stream must be a JetStream stream name (no spaces, '.', '*' or '>'), not {stream!r}.")
        return stream

    def read_messages(
        self, stream: str, *, to_position: int | None = None, filter_subjects: Sequence[str] = ()
    ) -> AsyncIterator[list[StoredMessage]]:
        """Every message of ``stream`` (another stream on this server: a dead-letter stream, say) matching
        ``filter_subjects``, in order, exactly once, in batches, up to ``to_position`` (default: the stream's
        last position at the start). A stream that does not exist raises :class:`StreamConfigError`."""
        check_optional_int("to_position", to_position, 0, what="a position")
        return self._read_messages(self._stream_name(stream), to_position, list(filter_subjects))

    async def _read_messages(
        self, stream: str, to_position: int | None, filter_subjects: list[str]
    ) -> AsyncIterator[list[StoredMessage]]:
        if to_position is None:
            info = await self._inbox.api(
                Subjects(stream).stream_info(), b"", self.settings.request_timeout_s,
                what=f"Reading the last position of stream {stream!r}",
            )
            error = info.get("error")
            if error is not None:
                raise StreamConfigError(f"Cannot read stream {stream!r}: {error.get('description')}.")
            to_position = int((info.get("state") or {}).get("last_seq") or 0)
        if to_position < 1:
            return
        async for batch in self._reader.read_messages(stream, to_position=to_position, filter_subjects=filter_subjects):
            yield batch

    def replay(
        self,
        *,
        from_position: int = 1,
        to_position: int | None = None,
        categories: Sequence[str] | None = None,
        live: bool = False,
        batch: int = 1000,
        heartbeat_s: float = 1.0,
        types: Collection[str] | None = None,
    ) -> AsyncIterator[Replayed]:
        """The stream's events in global order, in batches, each event exactly once: what projections read.

        Up to ``to_position`` (default: the last position at the start), or,
        with ``live``, forever (surviving server restarts, as :meth:`subscribe`).
        With ``types``, events of other types are skipped without being
        decoded and counted in :attr:`Replayed.skipped`; every batch says the
        last position it covers. Arguments are checked at the call, as for
        :meth:`read_all` and :meth:`subscribe`.
        """
        check_int("from_position", from_position, 1, what="a position")
        check_optional_int("to_position", to_position, 0, what="a position")
        check_categories(categories)
        check_bool("live", live)
        check_int("batch", batch, 1, MAX_BATCH)
        check_seconds("heartbeat_s", heartbeat_s, 0.05, 3600.0)
        if types is not None and (isinstance(types, str) or not all(isinstance(t, str) for t in types)):
            raise InvalidArgumentError(
                f"types must be a collection of event type names (str), not {types!r}: e.g. types={{'Deposited'}}."
            )
        return self._reader.replay(
            from_position=from_position, to_position=to_position, categories=categories, live=live, batch=batch,
            heartbeat_s=heartbeat_s, types=types,
        )

    def subscribe(
        self,
        *,
        from_position: int = 1,
        categories: Sequence[str] | None = None,
        batch: int = 1000,
        heartbeat_s: float = 1.0,
    ) -> AsyncIterator[list[RecordedEvent]]:
        """Catch up from ``from_position``, then follow live, in batches; survives server restarts.

        Arguments are checked at the call as for :meth:`read_all`; ``heartbeat_s``
        is a number of seconds from 0.05 to 3600.
        """
        check_int("from_position", from_position, 1, what="a position")
        check_categories(categories)
        check_int("batch", batch, 1, MAX_BATCH)
        check_seconds("heartbeat_s", heartbeat_s, 0.05, 3600.0)
        return self._reader.subscribe(
            from_position=from_position, categories=categories, batch=batch, heartbeat_s=heartbeat_s
        )

    def decode(self, seq: int, msg: Any) -> list[RecordedEvent]:
        """Decode one raw stream message (from your own consumer) into its events."""
        return self._reader.decode(seq, msg)

    def filter_subjects(self, categories: Sequence[str] | None = None) -> list[str]:
        """The NATS subject filters that select ``categories`` (all events when None)."""
        check_categories(categories)
        return self._reader.filter_subjects(categories)

    # -- inspecting ---------------------------------------------------------

    async def state(self, stream_id: StreamId) -> StreamState:
        """An entity's current version and the position of its last commit, from the server."""
        check_stream_id("stream_id", stream_id)
        return await self._appender.entities.state(stream_id)

    async def version(self, stream_id: StreamId) -> int:
        """An entity's current version (its number of events; 0 if it has none)."""
        return (await self.state(stream_id)).version

    async def last_position(self) -> int:
        """The stream's last position (0 when empty)."""
        return await self._reader.last_position()

    async def info(self) -> StoreInfo:
        """The stream's last position, commit count and size."""
        timeout_s = self.settings.request_timeout_s
        try:
            with map_nats_error(f"Reading the state of stream {self.settings.stream!r}", timeout_s, closed=self._replays.is_closed):
                state = (await self.nc.jetstream(timeout=timeout_s).stream_info(self.settings.stream)).state
        except NotFoundError as exc:
            raise StreamConfigError(
                f"There is no stream {self.settings.stream!r} on the server: create it with EventStore.connect() "
                "(which does) or store.ensure_stream(), or check the stream setting (JETSOURCING_STREAM)."
            ) from exc
        return StoreInfo(self.settings.stream, state.last_seq, state.first_seq, state.messages, state.bytes)

    async def pending(self, after: int, categories: Sequence[str] | None = None) -> Pending:
        """How many commits of ``categories`` (default: all) lie after position ``after``, and the oldest of them.

        This is a reader's lag, counted by the server: one direct get per
        category finds its oldest pending commit, whose ``Nats-Num-Pending``
        says how many more follow. Commits, not events: a commit of several
        events counts once.
        """
        check_int("after", after, 0, what="a position")
        check_categories(categories)
        commits = 0
        firsts: list[tuple[int, str]] = []
        what = f"Counting the commits after position {after}"
        for subject in self.filter_subjects(categories):  # disjoint filters: their counts add up
            for msg in await self._appender.direct.direct_get({"seq": after + 1, "next_by_subj": subject, "batch": 1}, what=what):
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
        ``offset`` is an int >= 0 and ``limit`` >= 1; else :class:`InvalidArgumentError`.
        """
        validate_category(category)
        check_int("offset", offset, 0)
        check_int("limit", limit, 1)
        what = f"Listing the entities of category {category!r}"
        subjects = (await self._subject_counts(f"{category}.*", what))[offset : offset + limit]
        versions = await self._last_versions([s for s, _ in subjects], what)
        prefix_len = len(self.settings.subject_prefix) + len(category) + 2
        return [
            EntityInfo(StreamId(category, decode_entity_id(s[prefix_len:])), versions.get(s, 0), commits)
            for s, commits in subjects
        ]

    async def event_count(self) -> int:
        """How many events the store holds (the sum of every entity's version; one multi-last get per 1,000 entities)."""
        what = f"Counting the events of stream {self.settings.stream!r}"
        subjects = await self._subject_counts(">", what)
        return sum((await self._last_versions([s for s, _ in subjects], what)).values())

    async def _subject_counts(self, pattern: str, what: str) -> list[tuple[str, int]]:
        timeout_s = self.settings.request_timeout_s
        with map_nats_error(what, timeout_s, closed=self._replays.is_closed):
            info = await self.nc.jetstream(timeout=timeout_s).stream_info(
                self.settings.stream, subjects_filter=f"{self.settings.subject_prefix}.{pattern}"
            )
        return sorted((info.state.subjects or {}).items())

    async def _last_versions(self, subjects: list[str], what: str) -> dict[str, int]:
        versions: dict[str, int] = {}
        # The server answers a multi-last get for at most 1,024 subjects (413 beyond).
        for start in range(0, len(subjects), 1000):
            chunk = subjects[start : start + 1000]
            for msg in await self._appender.direct.direct_get({"multi_last": chunk, "batch": len(chunk)}, what=what):
                headers = msg.headers or {}
                versions[headers[Header.SUBJECT]] = commit_version(headers, headers[Header.SUBJECT])
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

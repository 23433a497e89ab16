"""Reactors: event handlers with side effects (send an email, call a service, issue commands), run by workers.

A read model can rebuild itself; a reactor cannot take back an email. So a
reactor does not track a checkpoint of its own: its progress is a **durable
JetStream pull consumer** with explicit acknowledgements, named after the
reactor, shared by every worker that runs it. If you are here to read the
code: :class:`Reactor` (the definition), :class:`ReactorStart`, then
:class:`ReactorWorker` (the pull loop and the verdicts), then
:mod:`.dead_letters` and :mod:`.errors`.

What a reactor guarantees:

* **At-least-once.** Every event of the reactor's categories, from its start
  position on, is handed to a handler until a handler call for it returns (or
  the event is dead-lettered). An event can be handled **more than once**: when
  a worker dies or is stopped after handling it but before the server recorded
  the acknowledgement, when its handling outlives ``ack_wait_s`` without a
  heartbeat, or when a later event of the same commit fails (the commit is
  retried whole). Make effects idempotent: issue commands with
  ``idempotency_key=reactor.idempotency_key(event)`` so a redelivery stores
  nothing new (within the store's ``duplicate_window_s``).
* **Shared work.** Any number of workers (tasks, processes, machines) run one
  reactor; the server hands each message to one of them at a time. There is
  no order across workers, nor within one worker with ``concurrency > 1``, nor
  around a retry (later events go ahead while a failed one waits).
* **Verdicts.** The handler returns for every event of a message: the message is
  acknowledged (and the server confirms it). The handler raises: the message is
  redelivered after ``retry_backoff_s`` (``nak`` with a delay). The handler raises
  :class:`PoisonEvent`, or the last of ``max_deliver`` deliveries fails, or the
  commit cannot be decoded: the event is stored in the dead-letter stream with
  the reason, then terminated (never delivered again).
* **Long work.** While a handler runs, the worker tells the server the message
  is in progress (``+WPI``) every third of ``ack_wait_s``, so it is not handed
  to another worker; a worker that dies stops doing so, and its messages go to
  the others after ``ack_wait_s``.
* **Start.** A new reactor starts at :meth:`ReactorStart.all`,
  :meth:`ReactorStart.new`, a position or a time. Once its consumer exists,
  workers resume where it is; changing ``start`` later has no effect (delete
  the consumer to start over).

Example::

    async def send_welcome(event: RecordedEvent) -> None:
        await mailer.send(event.data.email, idempotency_key=welcome.idempotency_key(event))

    welcome = Reactor("welcome-mail", handlers={"Registered": send_welcome}, categories=["User"])
    await run_reactor(store, welcome, concurrency=8)        # runs until cancelled
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, Literal

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from pydantic import BaseModel

from eventstore import (
    Backoff,
    EventStore,
    EventStoreError,
    Header,
    RecordedEvent,
    ServerUnavailableError,
    TypeRegistry,
    stop_task,
)
from eventstore.jetstream import ride_out_jetstream
from eventstore.streams import validate_category

from ..metrics import REACTOR_DEAD_LETTERS, REACTOR_DELIVERIES, REACTOR_REDELIVERIES
from .status import REACTOR_METADATA
from .dead_letters import DeadLetterReason, ensure_dead_letter_stream, publish_dead_letter
from .errors import DeadLetterStreamError, PoisonEvent, ReactorConfigError, ReactorConsumerError, ReactorError

__all__ = ["Reactor", "ReactorHandler", "ReactorStart", "ReactorStats", "ReactorWorker", "run_reactor"]

log = logging.getLogger("jetsourcing.reactors")

ReactorHandler = Callable[[RecordedEvent], Awaitable[object]]
"""An async function called with one event; it returns when the event's effect is done and raises when not."""

_NS = 1_000_000_000


def _nak(delay_s: float) -> bytes:
    """A negative acknowledgement asking the server to redeliver after ``delay_s`` (at once if not positive)."""
    return b"-NAK" if delay_s <= 0 else b"-NAK " + json.dumps({"delay": int(delay_s * _NS)}).encode()
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class ReactorStart:
    """Where a *new* reactor begins: every stored event, new events only, a position, or a time.

    It applies only when the reactor's consumer is first created; after that,
    workers resume where the consumer is.
    """

    policy: Literal["all", "new", "position", "time"]
    position: int | None = None
    at: datetime | None = None

    @classmethod
    def all(cls) -> "ReactorStart":
        """Handle every stored event of the reactor's categories, then new ones."""
        return cls("all")

    @classmethod
    def new(cls) -> "ReactorStart":
        """Handle only events appended after the reactor's consumer is created."""
        return cls("new")

    @classmethod
    def from_position(cls, position: int) -> "ReactorStart":
        """Handle events at ``position`` and after (positions are the store's global order, from 1)."""
        if not isinstance(position, int) or position < 1:
            raise ReactorConfigError(f"ReactorStart.from_position needs a position >= 1, not {position!r}.")
        return cls("position", position=position)

    @classmethod
    def from_time(cls, when: datetime) -> "ReactorStart":
        """Handle events stored at ``when`` or later (``when`` must be timezone-aware; the server's clock decides)."""
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise ReactorConfigError(
                f"ReactorStart.from_time needs a timezone-aware datetime, e.g. datetime.now(timezone.utc), not {when!r}."
            )
        return cls("time", at=when)

    def consumer_fields(self) -> dict[str, object]:
        """The JetStream consumer settings for this start (``deliver_policy`` and its option)."""
        if self.policy == "position":
            return {"deliver_policy": "by_start_sequence", "opt_start_seq": self.position}
        if self.policy == "time" and self.at is not None:
            return {
                "deliver_policy": "by_start_time",
                "opt_start_time": self.at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            }
        return {"deliver_policy": self.policy}

    def __str__(self) -> str:
        if self.policy == "position":
            return f"from position {self.position}"
        if self.policy == "time":
            return f"from {self.at}"
        return self.policy


@dataclass(frozen=True, eq=False)
class Reactor:
    """What a reactor does and how its deliveries are retried. Immutable; validated on construction.

    * ``name`` names the durable consumer (and the reactor's dead letters):
      letters, digits, ``_`` and ``-``. Workers with the same name share work.
    * ``handlers`` maps event type names (or registered model classes) to
      handlers; ``handler`` handles every other event. Events with no handler
      are acknowledged without a call. At least one handler is needed.
    * ``categories`` limits the reactor to those categories (None: every event).
    * ``max_deliver``: deliveries of one event before it is dead-lettered.
    * ``retry_backoff_s``: the delay before delivery n+1 after delivery n failed
      is ``retry_backoff_s[n-1]`` (the last value repeats).
    * ``ack_wait_s``: how long the server waits for a verdict before it hands
      the event to another worker; heartbeats extend it while a handler runs,
      so it bounds how fast a dead worker's events move on, not handler time.
    * ``start``: see :class:`ReactorStart`.
    * ``max_ack_pending``: events in flight across all workers at most.

    Handlers are async and must not block the event loop (run blocking work
    with ``asyncio.to_thread``): a blocked loop sends no heartbeats, so the
    server hands the event to another worker after ``ack_wait_s``.
    """

    name: str
    handler: ReactorHandler | None = None
    handlers: Mapping[str | type[BaseModel], ReactorHandler] = field(default_factory=dict)
    categories: Sequence[str] | None = None
    max_deliver: int = 5
    retry_backoff_s: Sequence[float] = (1.0, 5.0, 30.0)
    ack_wait_s: float = 30.0
    start: ReactorStart = field(default_factory=ReactorStart.all)
    max_ack_pending: int = 1000
    description: str = ""

    def handlers_by_type(self, registry: TypeRegistry) -> dict[str, ReactorHandler]:
        """The handlers keyed by stored type name (a class key by its name in ``registry``); events of other
        types go to :attr:`handler`."""
        handlers: dict[str, ReactorHandler] = {}
        for key, fn in self.handlers.items():
            try:
                type_name = key if isinstance(key, str) else registry.name_of(key)[0]
            except EventStoreError as exc:
                raise ReactorConfigError(f"Reactor {self.name!r}: {exc}") from exc
            handlers[type_name] = fn
        return handlers

    async def handle(self, events: Sequence[RecordedEvent], handlers: Mapping[str, ReactorHandler]) -> tuple[int, int]:
        """Run one commit's events through ``handlers`` (from :meth:`handlers_by_type`), in order; return how many
        were handled and skipped (no handler). A handler's exception propagates."""
        handled = skipped = 0
        for event in events:
            fn = handlers.get(event.type, self.handler)
            if fn is None:
                skipped += 1
                continue
            await fn(event)
            handled += 1
        return handled, skipped

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ReactorConfigError(
                f"Invalid reactor name {self.name!r}: use 1 to 64 letters, digits, '_' or '-' (it names a JetStream "
                "consumer), e.g. 'welcome-mail'."
            )
        if self.handler is None and not self.handlers:
            raise ReactorConfigError(f"Reactor {self.name!r} has no handler: give handler=... or handlers={{...}}.")
        for key, fn in self.handlers.items():
            if not (isinstance(key, str) or (isinstance(key, type) and issubclass(key, BaseModel))):
                raise ReactorConfigError(
                    f"Reactor {self.name!r}: handlers keys must be event type names or event classes, not {key!r}."
                )
            if not callable(fn):
                raise ReactorConfigError(f"Reactor {self.name!r}: the handler for {key!r} is not callable.")
        if self.categories is not None:
            try:
                categories = tuple(validate_category(c) for c in self.categories)
            except EventStoreError as exc:
                raise ReactorConfigError(f"Reactor {self.name!r}: {exc}") from exc
            if not categories:
                raise ReactorConfigError(
                    f"Reactor {self.name!r}: categories is empty; give None to react to every category."
                )
            object.__setattr__(self, "categories", categories)
        if not isinstance(self.max_deliver, int) or self.max_deliver < 1:
            raise ReactorConfigError(f"Reactor {self.name!r}: max_deliver must be an int >= 1, not {self.max_deliver!r}.")
        backoff = tuple(float(s) for s in self.retry_backoff_s)
        if not backoff or any(s < 0 for s in backoff):
            raise ReactorConfigError(
                f"Reactor {self.name!r}: retry_backoff_s must hold at least one delay >= 0 seconds, not "
                f"{self.retry_backoff_s!r}."
            )
        object.__setattr__(self, "retry_backoff_s", backoff)
        if not self.ack_wait_s >= 0.3:
            raise ReactorConfigError(f"Reactor {self.name!r}: ack_wait_s must be at least 0.3 seconds, not {self.ack_wait_s!r}.")
        if not isinstance(self.max_ack_pending, int) or self.max_ack_pending < 1:
            raise ReactorConfigError(f"Reactor {self.name!r}: max_ack_pending must be an int >= 1.")
        object.__setattr__(self, "handlers", MappingProxyType(dict(self.handlers)))

    def idempotency_key(self, event: RecordedEvent, step: str = "") -> str:
        """The idempotency key for a command this reactor issues in reaction to ``event``.

        The same on every redelivery of the event, different for every event
        and reactor; give ``step`` to tell several commands for one event apart.
        Pass it to :meth:`EventStore.append` so a redelivery stores nothing new.
        """
        key = f"{self.name}:{event.event_id}"
        return f"{key}:{step}" if step else key

    def retry_delay_s(self, delivery: int) -> float:
        """The delay before the next delivery after delivery number ``delivery`` (1-based) failed."""
        backoff = tuple(self.retry_backoff_s)
        return backoff[min(max(delivery, 1), len(backoff)) - 1]

    def consumer_config(self, store: EventStore) -> dict[str, object]:
        """The JetStream consumer configuration this reactor needs on ``store``'s stream."""
        config: dict[str, object] = {
            "durable_name": self.name,
            "name": self.name,
            "description": self.description or f"jetsourcing reactor {self.name}",
            "ack_policy": "explicit",
            "ack_wait": int(self.ack_wait_s * _NS),
            "max_deliver": self.max_deliver,
            "max_ack_pending": self.max_ack_pending,
            "replay_policy": "instant",
            "metadata": {REACTOR_METADATA: self.name},
            **self.start.consumer_fields(),
        }
        filters = store.filter_subjects(self.categories)
        if len(filters) == 1:
            config["filter_subject"] = filters[0]
        else:
            config["filter_subjects"] = filters
        return config


@dataclass
class ReactorStats:
    """A worker's live counters; logged when the worker stops.

    ``handled``: events handled in acknowledged messages. ``skipped``: events
    without a handler. ``retried``: deliveries that failed and were handed back
    for a retry. ``dead_lettered``: messages this worker stored in the
    dead-letter stream. ``redelivered``: messages it received that had been
    delivered before (to it or to another worker).
    """

    handled: int = 0
    skipped: int = 0
    retried: int = 0
    dead_lettered: int = 0
    redelivered: int = 0


@dataclass(slots=True)
class _Pull:
    """One outstanding pull request: how many messages it may still bring, and until when."""

    remaining: int
    deadline: float
    received: int = 0


# The editable consumer settings a worker keeps in line with its Reactor definition.
_EDITABLE = ("description", "ack_wait", "max_deliver", "max_ack_pending")


class ReactorWorker:
    """Runs one :class:`Reactor` on one event store connection: pulls, calls handlers, gives verdicts.

    Start as many workers as you like (each with its own connection, in one
    process or many): they share the reactor's durable consumer and so its work.
    ``concurrency`` is how many messages this worker handles at once.

    ``run()`` runs until :meth:`stop` (graceful: no new messages, the ones in
    hand are finished and acknowledged), until cancelled (handlers in hand are
    cancelled and their messages handed back at once), or, with
    ``until_idle=True``, until the reactor has nothing pending nor in flight
    anywhere (a burst mode for tests, CI and batch jobs). Prefer ``stop()``:
    an event handed back on its last delivery is dead-lettered.

    ``pull_expires_s`` is how long one pull request waits for new events
    (default 2 s, 0.25 s with ``until_idle``), and so at most how long
    ``stop()`` keeps listening to hand back late messages; ``name`` labels this worker in
    logs.

    Every running worker of a reactor also listens (as one queue group) for
    the server's max-deliveries advisory, and dead-letters an event whose last
    delivery ended without a verdict because its worker died. The server sends
    that advisory when it next serves a pull request of the reactor, after
    ``ack_wait_s``: to a surviving worker, or, when the dead worker was the
    only one, to the next worker that starts (it subscribes before it pulls),
    however long after.
    """

    def __init__(
        self,
        store: EventStore,
        reactor: Reactor,
        *,
        concurrency: int = 1,
        until_idle: bool = False,
        pull_expires_s: float | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ReactorConfigError(f"concurrency must be an int >= 1, not {concurrency!r}.")
        if pull_expires_s is not None and pull_expires_s < 0.05:
            raise ReactorConfigError(f"pull_expires_s must be at least 0.05 seconds, not {pull_expires_s!r}.")
        self.store = store
        self.reactor = reactor
        self.concurrency = concurrency
        self.until_idle = until_idle
        self.name = name or reactor.name
        self.stats = ReactorStats()
        # The reactor's metric counters, looked up once rather than per message.
        self._delivered, self._redelivered, self._dead_lettered = (
            metric.labels(reactor.name) for metric in (REACTOR_DELIVERIES, REACTOR_REDELIVERIES, REACTOR_DEAD_LETTERS)
        )
        self._expires_s = pull_expires_s if pull_expires_s is not None else (0.25 if until_idle else 2.0)
        self._api_timeout_s = store.settings.request_timeout_s
        self._stream = store.settings.stream
        self._consumer = store.durable_consumer(reactor.name)
        self._handlers: dict[str, ReactorHandler] = {}
        self._inbox = ""
        self._pulls: dict[str, _Pull] = {}
        self._counter = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._flights: dict[str, tuple[Msg, float]] = {}  # reply subject -> (message, last sign of life)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()  # set by stop(): ends a wait for JetStream at start
        self._stopping = False
        self._empty = False
        self._failure: ReactorError | None = None
        self._ready = False

    # -- setup ----------------------------------------------------------------

    async def setup(self) -> None:
        """Create (or bring in line) the reactor's consumer and the dead-letter stream. Idempotent; ``run()`` calls it.

        Call it ahead of ``run()`` to fix where a :meth:`ReactorStart.new` reactor
        starts, e.g. at deploy time. A JetStream that elects a leader or loses
        replies meanwhile is waited out, as the outage policy says (the store's
        ``outage_limit_s``; None: for as long as it takes), or until :meth:`stop`.
        """
        self._handlers = self.reactor.handlers_by_type(self.store.registry)
        settings = self.store.settings
        await ride_out_jetstream(
            self._ensure_consumer, what=f"reactor {self.reactor.name}: setting up its consumer", logger=log,
            timeout_s=settings.request_timeout_s, requests=6,  # up to three reads, and creates or updates
            limit_s=settings.outage_limit_s, stop=self._stop,
        )
        await ensure_dead_letter_stream(self.store, long_running=True, stop=self._stop)
        r = self.reactor
        span_s = sum(r.retry_delay_s(n) for n in range(1, r.max_deliver))
        if span_s > self.store.settings.duplicate_window_s:
            log.warning(
                "reactor %s: its retries span %.0f s, more than the store's duplicate window of %.0f s: a command "
                "reissued after that with the same idempotency key and expected version ANY is stored again. "
                "Shorten retry_backoff_s or max_deliver, or raise duplicate_window_s.",
                r.name, span_s, self.store.settings.duplicate_window_s,
            )
        self._ready = True

    async def _ensure_consumer(self) -> None:
        name, stream, consumer = self.reactor.name, self._stream, self._consumer
        wanted = self.reactor.consumer_config(self.store)
        for _ in range(3):
            info = await consumer.info()
            if info.error is None:
                await self._update_consumer(info.info["config"], wanted)
                return
            if info.stream_not_found:
                raise ReactorConsumerError(
                    f"Stream {stream!r} does not exist, so reactor {name!r} cannot start. Connect with "
                    "EventStore.connect() (which creates it) or call store.ensure_stream()."
                )
            if not info.not_found:
                raise ReactorConsumerError(f"Could not read the consumer of reactor {name!r}: {info.description}")
            created = await consumer.create(wanted)
            if created.error is None:
                log.info("reactor %s: created its consumer on stream %s, starting %s", name, stream, self.reactor.start)
                return
            if not created.exists_already:
                raise ReactorConsumerError(
                    f"The server refused to create the consumer of reactor {name!r}: {created.description}. "
                    "Check the reactor's settings (max_deliver, ack_wait_s, categories)."
                )
            # Another worker created it at the same moment: read it and align it.
        raise ReactorConsumerError(f"Could not create or update the consumer of reactor {name!r}; retry.")

    async def _update_consumer(self, have: dict[str, Any], wanted: dict[str, object]) -> None:
        """Bring an existing consumer's editable settings in line with the Reactor; never its start."""
        name = self.reactor.name
        if have.get("deliver_subject"):
            raise ReactorConsumerError(
                f"A push consumer named {name!r} already exists on stream {self._stream!r}; a reactor needs a pull "
                "consumer. Rename the reactor or delete that consumer."
            )
        if have.get("ack_policy") != "explicit":
            raise ReactorConsumerError(
                f"A consumer named {name!r} already exists on stream {self._stream!r} with ack policy "
                f"{have.get('ack_policy')!r}; a reactor needs explicit acks. Rename the reactor or delete that consumer."
            )
        if have.get("deliver_policy") != wanted["deliver_policy"]:
            log.info(
                "reactor %s: its consumer exists (deliver policy %s), so start=%s is ignored; it resumes where it is",
                name, have.get("deliver_policy"), self.reactor.start,
            )
        merged = dict(have)
        for key in _EDITABLE:
            merged[key] = wanted[key]
        have_filters = [have["filter_subject"]] if have.get("filter_subject") else list(have.get("filter_subjects") or [])
        wanted_filters = self.store.filter_subjects(self.reactor.categories)
        merged.pop("filter_subject", None)
        merged.pop("filter_subjects", None)
        if len(wanted_filters) == 1:
            merged["filter_subject"] = wanted_filters[0]
        else:
            merged["filter_subjects"] = wanted_filters
        # The server adds metadata of its own (``_nats.*``): keep it, and mark the consumer as this reactor's.
        merged["metadata"] = {**(have.get("metadata") or {}), REACTOR_METADATA: name}
        marked = (have.get("metadata") or {}).get(REACTOR_METADATA) == name
        if marked and all(have.get(k) == merged[k] for k in _EDITABLE) and sorted(have_filters) == sorted(wanted_filters):
            return
        updated = await self._consumer.update(merged)
        if updated.error is not None:
            raise ReactorConsumerError(
                f"The server refused to update the consumer of reactor {name!r}: "
                f"{updated.description}. Delete the consumer to recreate it with the new settings "
                "(it then starts again from its start position)."
            )
        log.info("reactor %s: updated its consumer's settings", name)

    # -- running --------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run()`` to return: it takes no new messages and finishes (and acknowledges) the ones in hand.

        Messages its open pull requests still bring are handed back, for
        redelivery once those requests have expired, so another worker gets
        them without waiting ``ack_wait_s``; ``run()`` returns once those
        requests have ended (``pull_expires_s``).

        A stopped worker stays stopped: ``run()`` called after ``stop()`` returns at once.
        """
        self._stopping = True
        self._stop.set()
        self._wake.set()

    async def run(self) -> ReactorStats:
        """Handle the reactor's events until stopped, cancelled or (``until_idle``) idle; return the counters.

        Raises :class:`ReactorConsumerError` if the consumer is deleted while
        running, and :class:`eventstore.ServerUnavailableError` if the server
        cannot be reached at start for longer than the outage policy allows
        (see :meth:`setup`).
        """
        if not self._ready:
            try:
                await self.setup()
            except ServerUnavailableError:
                if self._stopping:  # stopped while waiting for the server: nothing was taken
                    return self.stats
                raise
        nc = self.store.nc
        self._inbox = nc.new_inbox()
        # A backstop for the last delivery of an event whose worker died: the server's advisory, which one
        # running worker of the reactor (a queue group) turns into a dead letter.
        advisories: Subscription | None = await nc.subscribe(
            self._consumer.max_deliveries_subject(),
            queue=f"jetsourcing-reactor-{self.reactor.name}",
            cb=self._on_max_deliveries,
        )
        messages = await nc.subscribe(f"{self._inbox}.*", cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
        ended = asyncio.Event()
        ticker = asyncio.ensure_future(self._heartbeats(ended))
        started = time.monotonic()
        try:
            await self._pull_loop()
            self._stopping = True
            await self._finish()
        except BaseException:
            # Cancelled, or the consumer vanished: hand the messages in hand back at once. Leave the advisory
            # queue group first, so an advisory caused by a hand-back goes to a worker that stays.
            self._stopping = True
            await self._unsubscribe(advisories)
            advisories = None
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            for task in tasks:
                await stop_task(task, timeout_s=self._api_timeout_s)  # bounded: a cancellation can be swallowed
            raise
        finally:
            ended.set()
            await stop_task(ticker, grace_s=0.1, timeout_s=self._api_timeout_s)
            await self._unsubscribe(advisories)
            await self._unsubscribe(messages)
            self._pulls.clear()
            s = self.stats
            log.info(
                "reactor %s worker %s stopped after %.1f s: handled=%d skipped=%d retried=%d dead_lettered=%d "
                "redelivered=%d",
                self.reactor.name, self.name, time.monotonic() - started, s.handled, s.skipped, s.retried,
                s.dead_lettered, s.redelivered,
            )
        return self.stats

    async def _finish(self) -> None:
        """Graceful end: finish the messages in hand, then hand back what the open pull requests still bring.

        A pull request stays open at the server until it expires or is filled,
        and the server delivers to it even after this worker stopped listening:
        those messages would wait ``ack_wait_s`` for another worker. So the
        worker listens until its requests have ended (at most ``pull_expires_s``),
        handing each late message back (see :meth:`_hand_back`).
        """
        while True:
            while self._tasks:
                await asyncio.wait(set(self._tasks))
            now = time.monotonic()
            open_until = max((p.deadline for p in self._pulls.values()), default=now)
            if open_until <= now:
                return
            self._wake.clear()
            await self._pause(open_until - now)
            for token in [t for t, p in self._pulls.items() if p.deadline <= time.monotonic()]:
                del self._pulls[token]

    @staticmethod
    async def _unsubscribe(sub: Subscription | None) -> None:
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing on a dead connection must not hide the real outcome
                pass

    async def _pull_loop(self) -> None:
        threshold = max(1, self.concurrency // 2)
        backoff = Backoff(f"reactor {self.reactor.name}: pull request", log, first_s=0.1, cap_s=5.0)
        while not self._stopping:
            if self._failure is not None:
                raise self._failure
            if self.store.connection_lost.is_set():
                raise ServerUnavailableError(
                    f"Reactor {self.reactor.name!r}: the NATS connection was lost for longer than the outage limit "
                    f"({self.store.settings.outage_limit_s:g} s, JETSOURCING_OUTAGE_LIMIT_S); stopped."
                )
            now = time.monotonic()
            for token in [t for t, p in self._pulls.items() if p.deadline < now]:
                del self._pulls[token]  # lost (reconnect, server restart): its credit is free again
            self._wake.clear()
            outstanding = sum(p.remaining for p in self._pulls.values())
            want = self.concurrency - len(self._tasks) - outstanding
            if self.until_idle and self._empty and not self._tasks:
                # A request came back empty and nothing is in hand: once the other requests have ended
                # too, ask the server whether anything is pending or in flight at any worker.
                if not self._pulls:
                    self._empty = False
                    if await self._idle():
                        return
                    continue
            elif want > 0 and (not self._pulls or want >= threshold):
                self._counter += 1
                token = str(self._counter)
                self._pulls[token] = _Pull(want, now + self._expires_s + 1.0)
                try:
                    await self._consumer.pull(want, self._expires_s, f"{self._inbox}.{token}")
                    backoff.succeeded()
                except NatsError as exc:  # disconnected: nats-py reconnects; try again after a growing pause
                    del self._pulls[token]
                    await self._pause(backoff.failed(exc))
                continue
            await self._pause(1.0)

    async def _pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``, or until woken (a message, a finished task, ``stop()``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):  # unlike wait_for, never swallows a cancellation
                await self._wake.wait()

    async def _idle(self) -> bool:
        try:  # the consumer may be electing a leader: wait it out as at start (see setup())
            answer = await ride_out_jetstream(
                self._consumer.info, what=f"reactor {self.reactor.name}: reading its consumer", logger=log,
                timeout_s=self._api_timeout_s, limit_s=self.store.settings.outage_limit_s, stop=self._stop,
            )
        except ServerUnavailableError:
            if self._stopping:
                return False  # the pull loop ends on its stop flag
            raise
        if answer.error is not None:
            raise ReactorConsumerError(f"The consumer of reactor {self.reactor.name!r} is gone: {answer.description}")
        return bool(answer.info.get("num_pending", 0) == 0 and answer.info.get("num_ack_pending", 0) == 0)

    async def _on_msg(self, msg: Msg) -> None:
        if msg.reply:  # a message of the stream
            # It carries its own subject, not the request's: count it against the oldest request (the
            # server serves one client's requests in order).
            for oldest, request in self._pulls.items():
                request.remaining -= 1
                request.received += 1
                if request.remaining <= 0:
                    del self._pulls[oldest]
                break
            task = asyncio.ensure_future(self._process(msg))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)
            return
        # A status message, on the request's own inbox, ends that request: 404/408 no (more) messages,
        # 409 refused or consumer gone. 100 is an idle heartbeat.
        headers = msg.headers or {}
        status = headers.get(Header.STATUS, "")
        if status == "100":
            return
        token = msg.subject.rsplit(".", 1)[-1]
        pull = self._pulls.get(token)
        if pull is not None:
            del self._pulls[token]
            if pull.received == 0 and status in ("404", "408"):
                self._empty = True
        if status == "409" and "Deleted" in headers.get(Header.DESCRIPTION, ""):
            self._failure = ReactorConsumerError(
                f"The consumer of reactor {self.reactor.name!r} was deleted while its workers ran. Workers do not "
                "recreate it (that would restart the reactor from its start position); restart them to do so."
            )
        self._wake.set()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("reactor %s: unexpected worker error", self.reactor.name, exc_info=task.exception())

    async def _heartbeats(self, ended: asyncio.Event) -> None:
        """Send ``+WPI`` for every message whose handling has lasted a third of ack_wait since the last sign of life.

        Ends on ``ended``, not only on cancellation (which can be lost, see eventstore.tasks).
        """
        interval = self.reactor.ack_wait_s / 3
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval / 4):
                    await ended.wait()
            if ended.is_set():
                return
            now = time.monotonic()
            for reply, (msg, last) in list(self._flights.items()):
                if now - last >= interval:
                    self._flights[reply] = (msg, now)
                    try:
                        await msg.in_progress()
                    except Exception as exc:  # noqa: BLE001 - a lost heartbeat only risks a redelivery
                        log.debug("reactor %s: heartbeat failed: %s", self.reactor.name, exc)

    # -- verdicts -------------------------------------------------------------

    async def _process(self, msg: Msg) -> None:
        meta = msg.metadata
        position, delivery = meta.sequence.stream, meta.num_delivered
        if self._stopping:
            await self._hand_back(msg)  # arrived after stop(): for another worker
            return
        self._delivered.inc()
        if delivery > 1:
            self.stats.redelivered += 1
            self._redelivered.inc()
        reply = msg.reply
        self._flights[reply] = (msg, time.monotonic())
        try:
            try:
                events = self.store.decode(position, msg)
            except EventStoreError as exc:
                await self._dead_letter(msg, DeadLetterReason.UNDECODABLE, exc, position, delivery)
                return
            handled, skipped = await self.reactor.handle(events, self._handlers)
            await self._ack(msg, position)
            self.stats.handled += handled
            self.stats.skipped += skipped
        except PoisonEvent as exc:
            await self._dead_letter(msg, DeadLetterReason.POISON, exc, position, delivery)
        except asyncio.CancelledError:
            await self._hand_back(msg)  # cancelled worker: for another worker
            raise
        except Exception as exc:  # noqa: BLE001 - any handler failure is a retry; the verdict is the server's
            if delivery >= self.reactor.max_deliver:
                await self._dead_letter(msg, DeadLetterReason.MAX_DELIVER, exc, position, delivery)
            else:
                delay = self.reactor.retry_delay_s(delivery)
                log.warning(
                    "reactor %s: position %d failed on delivery %d of %d, retrying in %.1f s: %r",
                    self.reactor.name, position, delivery, self.reactor.max_deliver, delay, exc,
                )
                self.stats.retried += 1
                await self._reply(msg, _nak(delay))
        finally:
            self._flights.pop(reply, None)

    async def _hand_back(self, msg: Msg) -> None:
        """Return a message to the server for another worker, not to this worker's requests that are still open.

        The server serves a returned message to the oldest open pull request, and this worker's requests stay
        open until they expire: a plain ``-NAK`` would bring the message straight back here, again and again
        until its ``max_deliver`` was spent and it was dead-lettered unhandled. So it is returned with a delay
        that outlasts them (at most ``pull_expires_s`` + 1 s).
        """
        open_until = max((p.deadline for p in self._pulls.values()), default=0.0)
        await self._reply(msg, _nak(open_until - time.monotonic()))

    async def _reply(self, msg: Msg, body: bytes) -> None:
        """Send a verdict without waiting for the server (a lost one only causes a redelivery)."""
        try:
            await self.store.nc.publish(msg.reply, body)
        except Exception as exc:  # noqa: BLE001 - the message is redelivered after ack_wait anyway
            log.warning("reactor %s: could not send %r: %s", self.reactor.name, body[:5], exc)

    async def _ack(self, msg: Msg, position: int) -> None:
        try:
            await msg.ack_sync(timeout=self._api_timeout_s)
        except Exception as exc:  # noqa: BLE001 - at-least-once: an unconfirmed ack means a possible redelivery
            log.warning(
                "reactor %s: the acknowledgement of position %d was not confirmed (%s); it may be delivered again",
                self.reactor.name, position, exc,
            )

    async def _dead_letter(
        self, msg: Msg, reason: DeadLetterReason, exc: BaseException, position: int, delivery: int
    ) -> None:
        error = f"{type(exc).__name__}: {exc}"
        try:
            stored = await publish_dead_letter(
                self.store.nc, self.store.settings, reactor=self.reactor.name, reason=reason, error=error,
                deliveries=delivery, position=position, subject=msg.subject, headers=msg.headers, data=msg.data,
            )
        except DeadLetterStreamError as dlq_exc:
            # Keep the event: retry it later; on its last delivery the max-deliveries advisory tries again.
            log.error("reactor %s: %s; the event stays pending", self.reactor.name, dlq_exc)
            await self._reply(msg, _nak(self.reactor.retry_delay_s(delivery)))
            return
        await self._reply(msg, b"+TERM " + f"{reason.value}: {error}"[:500].encode())
        if stored:
            self.stats.dead_lettered += 1
            self._dead_lettered.inc()
        log.warning(
            "reactor %s: position %d dead-lettered (%s) after %d deliveries: %s",
            self.reactor.name, position, reason.value, delivery, error,
        )

    async def _on_max_deliveries(self, advisory: Msg) -> None:
        # In a task of its own, counted as work in hand: stop() and until_idle wait for it to finish.
        task = asyncio.ensure_future(self._dead_letter_lost(advisory))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    async def _dead_letter_lost(self, advisory: Msg) -> None:
        """An event's last delivery ended without a verdict (its worker died or was cancelled): dead-letter it."""
        try:
            body = json.loads(advisory.data)
            position, deliveries = int(body["stream_seq"]), int(body.get("deliveries", 0))
            found = await self._consumer.stored(position)
            headers = dict(found.headers or {})
            if headers.get(Header.STATUS):
                raise DeadLetterStreamError(f"position {position} could not be read back: {headers}")
            stored = await publish_dead_letter(
                self.store.nc, self.store.settings, reactor=self.reactor.name, reason=DeadLetterReason.MAX_DELIVER,
                error=(
                    f"no verdict on delivery {deliveries} of {self.reactor.max_deliver}: the worker handling it "
                    "stopped or died, or the handler outlived ack_wait_s"
                ),
                deliveries=deliveries, position=position, subject=headers.get(Header.SUBJECT, ""), headers=headers,
                data=found.data,
            )
        except Exception as exc:  # noqa: BLE001 - a callback must not raise; say what was lost
            log.error(
                "reactor %s: an event reached max_deliver without a verdict and could not be dead-lettered: %s (%s)",
                self.reactor.name, exc, advisory.data[:300],
            )
            return
        if stored:
            self.stats.dead_lettered += 1
            self._dead_lettered.inc()
            log.warning("reactor %s: position %d dead-lettered after %d deliveries without a verdict",
                        self.reactor.name, position, deliveries)


async def run_reactor(
    store: EventStore,
    reactor: Reactor,
    *,
    until_idle: bool = False,
    concurrency: int = 1,
) -> ReactorStats:
    """Run one worker of ``reactor`` on ``store``'s connection until cancelled (or, ``until_idle``, until idle).

    Delivery is at-least-once (see the module docs). Returns the worker's
    counters, which it also logs when it stops. For :meth:`ReactorWorker.stop`
    and live counters, use :class:`ReactorWorker` directly.
    """
    return await ReactorWorker(store, reactor, concurrency=concurrency, until_idle=until_idle).run()

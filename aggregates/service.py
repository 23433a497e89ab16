"""Serve an application's commands over NATS request-reply, in a queue group.

::

    service = CommandService(store)

    @service.command(accounts, Deposit)            # serves cmd.Account.Deposit
    def deposit(account: Account, command: Deposit) -> None:
        account.deposit(command.amount)

    async with service:                            # subscribed; leaving drains in-flight commands
        await stop_event.wait()

Every process that serves the same subjects with the same ``queue`` shares
the work: NATS hands each request to exactly one of them, so more processes
serve more commands. With routing (the default), the workers split the
aggregate ids into partitions (:mod:`aggregates.routing`, listed in a key-value
bucket by :mod:`aggregates.membership`): a client sends a command on its
aggregate's partition subject, so one aggregate's commands reach one worker
while it lives and that worker's cache stays current; the partitions move by
themselves when workers join, leave or die. Each request runs through :meth:`Repository.execute`
(retries on conflicts, the command id as the idempotency key), so a client
that resends a command with the same id after a timeout or a crashed worker
gets it applied once. The wire format is in :mod:`aggregates.command_messages`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pydantic_core
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from pydantic import BaseModel, ValidationError

from eventstore import (
    ConcurrencyError,
    EventStore,
    EventStoreError,
    InvalidArgumentError,
    InvalidEventError,
    ServerUnavailableError,
    stop_task,
)

from eventstore.connection import flush
from eventstore.validation import check_bool, check_int, check_seconds
from eventstore.wire import MAX_NOTE_BYTES, escape_key

from .aggregate import Aggregate
from .command_messages import check_name, check_prefix, command_subject, request_ids
from .errors import AggregateExistsError, AggregateNotFoundError, DomainError, InvalidAggregateIdError
from .commands import CacheStats
from .membership import Membership
from .metrics import COMMAND_SECONDS, COMMANDS, labelled
from .repository import Repository
from .routing import DEFAULT_PARTITIONS, check_partitions

__all__ = ["CommandService"]

log = logging.getLogger(__name__)

A = TypeVar("A", bound=Aggregate[Any])
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class _Route(Generic[A, M]):
    repository: Repository[A]
    model: type[M]
    handler: Callable[[A, M], Any]
    create: bool
    exist_ok: bool


class CommandService:
    """Serves commands on ``<subject_prefix>.<Category>.<Command>`` in the queue group ``queue``.

    Guarantees:

    * Every request that reaches the service gets exactly one reply: the new
      version and position, or an error saying what went wrong (a domain
      refusal, not found, an invalid request, a conflict after every retry,
      the store unavailable, or a failed handler). A malformed request (not a
      UTF-8 JSON object of the right shape, nested too deeply, a number out of
      range, a command that does not validate) is answered as ``invalid``,
      with no traceback in the log; nothing crashes the service.
    * A stored command is never reported as not stored: once its events are
      stored the reply is ``ok``. A value the handler returned that cannot be
      sent (not JSON-serialisable, or too large for a reply under the
      server's ``max_payload``) is left out and the reply says why in
      ``value_error`` (:attr:`CommandReply.value_error <aggregates.CommandReply.value_error>`).
    * A request without a usable command id is refused as ``invalid`` (the
      rules are in :mod:`aggregates.command_messages`): idempotency is never
      off. A resend of a stored command is answered with the first run's
      version, position and value (the value, as JSON of at most
      :data:`~eventstore.wire.MAX_NOTE_BYTES`, is stored with the command's
      commit; a larger one is answered with ``value_error``).
    * At most ``max_in_flight`` commands run at once (further requests wait
      in the subscription's queue).
    * :meth:`stop` stops taking requests, lets those already received run to
      their reply, and ends within ``drain_timeout_s``: commands still
      running then are cancelled (each either stored whole or not at all; the
      client's resend with the same command id finds out which).
    * With ``routing`` (the default), it also serves the partition subjects
      ``<subject>.<partition>`` of the partitions it owns among the live
      workers of its subject prefix (``partitions`` of them per category, the
      same number for every service of the prefix; a worker unlisted for
      ``member_ttl_s`` is taken as gone). Routing never decides correctness:
      every command runs under optimistic concurrency and its command id, and
      the plain subject stays served by every worker.
    """

    def __init__(
        self,
        store: EventStore,
        *,
        subject_prefix: str = "cmd",
        queue: str = "jetsourcing-commands",
        max_in_flight: int = 64,
        drain_timeout_s: float = 10.0,
        routing: bool = True,
        partitions: int = DEFAULT_PARTITIONS,
        member_ttl_s: float = 3.0,
    ) -> None:
        if not isinstance(store, EventStore):
            raise InvalidArgumentError(f"CommandService needs an EventStore, not {store!r:.80}.")
        self.store = store
        self.subject_prefix = check_prefix(subject_prefix)
        self.queue = check_name(queue, "queue group name")
        self.max_in_flight = check_int("max_in_flight", max_in_flight, 1, 100_000)
        self.drain_timeout_s = check_seconds("drain_timeout_s", drain_timeout_s, 0.001, 3600.0)
        self.routing = check_bool("routing", routing)
        self.partitions = check_partitions(partitions)
        self.member_ttl_s = check_seconds("member_ttl_s", member_ttl_s, 0.3, 3600.0)
        self._membership: Membership | None = None
        self._partition_subs: dict[str, Subscription] = {}
        self._releasing: dict[asyncio.Task[None], list[Subscription]] = {}  # partitions let go a beat later
        self._answered: collections.Counter[str] = collections.Counter()  # by outcome, for the stop's summary
        self._routes: dict[str, _Route[Any, Any]] = {}
        self._subs: list[Subscription] = []
        self._slots = asyncio.Semaphore(max_in_flight)
        self._running: set[asyncio.Task[None]] = set()
        self._refusing = False

    @property
    def subjects(self) -> list[str]:
        """The subjects served, one per command."""
        return list(self._routes)

    def add(
        self,
        repository: Repository[A],
        model: type[M],
        handler: Callable[[A, M], Any],
        *,
        name: str | None = None,
        create: bool = False,
        exist_ok: bool = False,
    ) -> str:
        """Serve commands of type ``model`` with ``handler(aggregate, command)``; returns the subject.

        ``name`` (default: the model's class name) is the command's subject
        token; ``create=True`` runs the handler on a new, empty aggregate, and
        answers a command for an id that has events already with
        :class:`AggregateExistsError` (``exist_ok=True``: runs it on the
        aggregate as it is), as :meth:`Repository.execute` does. ``handler``
        may be a coroutine function; what it returns is sent back as ``value``
        (see the class for a value that cannot be sent, and for resends). Add
        every command before :meth:`start`.
        """
        if not isinstance(repository, Repository):
            raise InvalidArgumentError(f"Commands are served through a Repository, not {repository!r:.80}.")
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise InvalidArgumentError(f"A command's model must be a pydantic BaseModel class, not {model!r:.80}.")
        if not callable(handler):
            raise InvalidArgumentError(f"A command's handler must be callable, not {handler!r:.80}.")
        check_bool("create", create)
        check_bool("exist_ok", exist_ok)
        if exist_ok and not create:
            raise InvalidArgumentError("exist_ok=True applies to a creating command: pass create=True with it.")
        if self._subs:
            raise InvalidArgumentError("Add commands before the service starts; it is already serving.")
        subject = command_subject(
            self.subject_prefix, repository.aggregate_type.category, check_name(name if name is not None else model.__name__)
        )
        if subject in self._routes:
            raise InvalidArgumentError(f"{subject} is served already; give one of the commands another name.")
        self._routes[subject] = _Route(repository, model, handler, create, exist_ok)
        return subject

    def command(
        self,
        repository: Repository[A],
        model: type[M],
        *,
        name: str | None = None,
        create: bool = False,
        exist_ok: bool = False,
    ) -> Callable[[Callable[[A, M], Any]], Callable[[A, M], Any]]:
        """Decorator form of :meth:`add`: the decorated function is the handler, returned unchanged."""

        def register(handler: Callable[[A, M], Any]) -> Callable[[A, M], Any]:
            self.add(repository, model, handler, name=name, create=create, exist_ok=exist_ok)
            return handler

        return register

    async def start(self, *, long_running: bool = False, stop: asyncio.Event | None = None) -> None:
        """Subscribe to every command's subject in the queue group (returns once the server has the interest).

        First the repositories' snapshot buckets are opened (:meth:`Repository.open_snapshots`; with
        ``long_running``, a JetStream that elects a leader is waited out as the outage policy says, until
        ``stop``). Raises :class:`~eventstore.ServerUnavailableError` when the server does not confirm the
        subscriptions in time; then none is left behind.
        """
        if not self._routes:
            raise InvalidArgumentError("The service has no commands: add some before starting it.")
        if self._subs:
            return
        for repository in {id(route.repository): route.repository for route in self._routes.values()}.values():
            await repository.open_snapshots(long_running=long_running, stop=stop)
        self._refusing = False
        nc = self.store.nc
        try:
            for subject in self._routes:
                self._subs.append(await nc.subscribe(subject, queue=self.queue, cb=self._receive))
            # Twice: nats-py writes a flush's PING at once, ahead of SUBs still queued for its flusher task, so the
            # first PONG can come before the server has the interest; the second PING follows the SUBs.
            for _ in range(2):
                await flush(nc, self.store.settings.request_timeout_s)
        except Exception as exc:
            subs, self._subs = self._subs, []
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            if isinstance(exc, (NatsError, asyncio.TimeoutError)):
                raise ServerUnavailableError(f"The command service could not subscribe to its subjects: {exc}") from exc
            raise
        if self.routing:
            membership = Membership(
                nc, self.subject_prefix, {route.repository.aggregate_type.category for route in self._routes.values()},
                self.partitions, self._repartition, member_ttl_s=self.member_ttl_s,
                replicas=self.store.settings.replicas, timeout_s=self.store.settings.request_timeout_s,
            )
            self._membership = membership
            try:
                await membership.start()  # within about the request timeout, joined or not
            except Exception:
                await self.stop()
                raise
        log.info("serving %d command(s) in queue group %r (pid %d): %s", len(self._routes), self.queue, os.getpid(),
                 ", ".join(self._routes))

    async def stop(self) -> None:
        """Stop taking requests, finish those received, and end within ``drain_timeout_s`` (see the class)."""
        membership, self._membership = self._membership, None
        if membership is not None:
            await membership.stop()  # unlisted first: the others take the partitions at their next beat
        released = [sub for subs in self._releasing.values() for sub in subs]
        for releasing in list(self._releasing):
            await stop_task(releasing, timeout_s=1.0)
        self._releasing = {}
        subs, self._subs = [*self._subs, *self._partition_subs.values(), *released], []
        self._partition_subs = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        # drain every subscription at once: unsubscribe, then run the callback on what was already delivered
        drains = [asyncio.ensure_future(sub.drain()) for sub in subs]  # type: ignore[no-untyped-call]
        if drains:
            await asyncio.wait(drains, timeout=self.drain_timeout_s)
        # Past the deadline, what is still queued is answered "unavailable" at once instead of run.
        self._refusing = True
        await asyncio.gather(*(stop_task(draining, timeout_s=1.0) for draining in drains))
        for sub, draining in zip(subs, drains):
            if draining.done() and not draining.cancelled() and draining.exception() is not None:
                log.debug("draining %s: %r", sub.subject, draining.exception())  # a closed connection: nothing arrives
        if self._running:
            _, late = await asyncio.wait(set(self._running), timeout=max(0.0, deadline - loop.time()))
            for task in late:
                task.cancel()
            if late:
                log.warning("%d command(s) still running after %.1fs were cancelled", len(late), self.drain_timeout_s)
                await asyncio.wait(late, timeout=1.0)
        if subs:  # it was serving: say what it did, as the projection daemon does when it stops
            outcomes = ", ".join(f"{outcome} {count:,}" for outcome, count in sorted(self._answered.items()))
            log.info("stopped: answered %s command(s)%s", f"{sum(self._answered.values()):,}",
                     f" ({outcomes})" if outcomes else "")

    @property
    def cache_stats(self) -> dict[str, CacheStats]:
        """Per aggregate category, how its commands found their aggregate in the repository's cache.

        With several repositories of one category, the first added is reported.
        """
        stats: dict[str, CacheStats] = {}
        for route in self._routes.values():
            stats.setdefault(route.repository.aggregate_type.category, route.repository.cache_stats)
        return stats

    @property
    def owned_partitions(self) -> dict[str, frozenset[int]]:
        """The partitions this worker serves now, per aggregate category (empty without routing)."""
        return self._membership.owned if self._membership is not None else {}

    async def _repartition(self, owned: dict[str, frozenset[int]]) -> None:
        """Serve the partition subjects of ``owned``; release the others a beat later, once their new owner serves them.

        The overlap is on purpose: a partition served twice for a moment costs a conflict at worst; a
        partition served by nobody would send its commands to the plain subject, to a cold cache.
        """
        wanted = {
            f"{subject}.{partition}"
            for subject, route in self._routes.items()
            for partition in owned.get(route.repository.aggregate_type.category, ())
        }
        nc = self.store.nc
        for subject in sorted(wanted - self._partition_subs.keys()):
            self._partition_subs[subject] = await nc.subscribe(subject, queue=self.queue, cb=self._receive)
        released = [self._partition_subs.pop(subject) for subject in sorted(self._partition_subs.keys() - wanted)]
        if released:
            task = asyncio.create_task(self._release(released))
            self._releasing[task] = released
            task.add_done_callback(lambda done: self._releasing.pop(done, None))

    async def _release(self, subs: list[Subscription]) -> None:
        await asyncio.sleep(self.member_ttl_s / 3)
        drains = [asyncio.ensure_future(sub.drain()) for sub in subs]  # type: ignore[no-untyped-call]
        try:
            await asyncio.wait(drains, timeout=self.drain_timeout_s)
        finally:
            for draining in drains:
                await stop_task(draining, timeout_s=1.0)

    async def __aenter__(self) -> CommandService:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _receive(self, msg: Msg) -> None:
        # nats-py runs a subscription's callbacks one at a time: hand each command to a task of its own.
        if not self._refusing:
            await self._slots.acquire()
            if not self._refusing:
                task = asyncio.create_task(self._handle(msg))
                self._running.add(task)
                task.add_done_callback(self._finished)
                return
            self._slots.release()
        await self._reply(msg, _error(
            "unavailable", "The command service stopped before this command started: nothing ran. Send it again "
            "(another member of the queue group takes it).",
        ))

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._slots.release()

    async def _handle(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("a command on %s without a reply subject was ignored: send commands as requests", msg.subject)
            return
        started = time.perf_counter()
        try:
            answer = await self._run(msg)
        except asyncio.CancelledError:
            # Stopped past the drain timeout: tell the client now rather than let it wait for its timeout.
            await self._reply(msg, _error(
                "unavailable", "The command service stopped before the command finished: it was stored whole or not "
                "at all. Send it again with the same command id to find out (it runs at most once).",
            ), outcome="cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - the last line of defence: a reply, never a dead service
            # Only before anything is stored: once the commit is stored, _run answers ok whatever happens.
            log.exception("command on %s failed", msg.subject)
            answer = _error("failed", f"The command's handler raised {type(exc).__name__}: {exc}", exc)
        await self._reply(msg, answer)
        labelled(COMMAND_SECONDS, self._command_of(msg.subject)).observe(time.perf_counter() - started)

    async def _reply(self, msg: Msg, answer: dict[str, Any], outcome: str | None = None) -> None:
        """Send ``answer`` to the requester, if it waits for one, and count it by its outcome."""
        if outcome is None:
            outcome = ("duplicate" if answer["duplicate"] else "ok") if answer["ok"] else answer["error"]
        labelled(COMMANDS, self._command_of(msg.subject), outcome).inc()
        self._answered[outcome] += 1
        if not msg.reply:
            return
        try:
            await self.store.nc.publish(msg.reply, _fitted(answer, self.store.nc.max_payload, msg.subject))
        except Exception as exc:  # noqa: BLE001 - the client is gone or the connection closed; it may resend
            log.warning("could not reply to a command on %s: %r", msg.subject, exc)

    def _command_of(self, subject: str) -> str:
        """The command subject of a plain or partition subject (metrics count commands, not partitions)."""
        return subject if subject in self._routes else subject.rpartition(".")[0]

    async def _run(self, msg: Msg) -> dict[str, Any]:
        route = self._routes.get(self._command_of(msg.subject))
        if route is None:  # pragma: no cover - only subscribed subjects arrive
            return _error("invalid", f"No command is served on {msg.subject}.")
        decoded = _decode(msg, route.model)
        if isinstance(decoded, dict):
            return decoded
        aggregate_id, command, command_id, correlation_id = decoded
        handler = route.handler
        try:
            result = await route.repository.execute(
                aggregate_id,
                lambda aggregate: handler(aggregate, command),
                create=route.create,
                exist_ok=route.exist_ok,
                command_id=command_id,
                correlation_id=correlation_id,
                note=_kept_value,
            )
        except DomainError as exc:
            return _error("domain", str(exc), exc)
        except AggregateNotFoundError as exc:
            return _error("not_found", str(exc), exc)
        except AggregateExistsError as exc:
            return _error("exists", str(exc), exc)
        except (InvalidAggregateIdError, InvalidArgumentError, InvalidEventError) as exc:  # too large, say
            return _error("invalid", str(exc), exc)
        except ConcurrencyError as exc:
            return _error("conflict", f"{exc} The service gave up after {route.repository.retry.attempts} attempts.", exc)
        except ServerUnavailableError as exc:
            return _error("unavailable", str(exc), exc)
        except EventStoreError as exc:  # the store's own, e.g. a stored event that no longer decodes
            log.error("command on %s failed: %s", msg.subject, exc)
            return _error("failed", str(exc), exc)
        answer: dict[str, Any] = {
            "ok": True, "version": result.version, "position": result.position, "duplicate": result.duplicate,
            "command_id": command_id,
        }
        try:
            answer.update(_value_fields(result.note) if result.duplicate else _sent_value(result.value))
        except Exception as exc:  # noqa: BLE001 - stored: the reply must say ok, whatever the value does
            answer["value_error"] = f"The value could not be read ({type(exc).__name__}); the command is stored."
        if "value_error" in answer:
            log.warning("command on %s (stored): its value is not sent: %s", msg.subject, answer["value_error"])
        return answer


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent, if a float holds it (1e999 would become infinity)."""
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"the number {text[:40]} is out of range")
    return number


def _not_json(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


# Made once: json.loads with hooks would build a decoder per request.
_REQUEST_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_not_json)
_VALUE_ENCODER = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def _decode(msg: Msg, model: type[BaseModel]) -> tuple[str, BaseModel, str, str | None] | dict[str, Any]:
    """The request's aggregate id, command, command id and correlation id, or the ``invalid`` reply saying why not.

    Every malformed input is the sender's mistake, answered ``invalid`` without a traceback: bytes that are not
    UTF-8 JSON (UnicodeDecodeError is a ValueError), nesting deeper than the parser's recursion limit
    (RecursionError), numbers out of range, a body of the wrong shape, a command its model refuses, an unusable
    command id.
    """
    try:
        request = _REQUEST_DECODER.decode(msg.data.decode())
    except (ValueError, RecursionError) as exc:
        return _error("invalid", f"The request to {msg.subject} is not JSON ({type(exc).__name__}: {exc}).", exc)
    if not isinstance(request, dict) or not isinstance(request.get("aggregate_id"), str) or "command" not in request:
        return _error(
            "invalid",
            f"The request to {msg.subject} must be a JSON object with \"aggregate_id\" (a string) and \"command\".",
        )
    try:
        command = model.model_validate(request["command"])
    except (ValidationError, RecursionError) as exc:
        return _error("invalid", f"The command is not a valid {model.__name__}: {exc}", exc)
    try:
        command_id, correlation_id = request_ids(msg.headers)
    except InvalidArgumentError as exc:
        return _error("invalid", str(exc), exc)
    return request["aggregate_id"], command, command_id, correlation_id


def _json_value(value: Any) -> tuple[Any, str]:
    """``value`` as JSON: the plain Python form and its compact text (ASCII, so a header can carry it)."""
    plain = pydantic_core.to_jsonable_python(value)
    return plain, _VALUE_ENCODER.encode(plain)


def _sent_value(value: Any) -> dict[str, Any]:
    """The reply's fields for a handler's value: ``value``, ``value_error`` when it cannot be JSON, or none."""
    if value is None:
        return {}
    try:
        return {"value": _json_value(value)[0]}
    except Exception as exc:  # noqa: BLE001 - any serialiser failure: cycles, bytes not UTF-8, NaN, huge ints...
        return {"value_error": _unserialisable(value, exc)}


def _unserialisable(value: Any, exc: Exception) -> str:
    return (f"The handler returned a {type(value).__name__} that cannot be sent as JSON ({type(exc).__name__}: "
            f"{str(exc)[:200]}); the command is stored. Return JSON-serialisable values (bytes as text or base64).")


def _kept_value(value: Any) -> str | None:
    """What is stored with the command's commit for a resend's reply: its reply fields as JSON (None: no value)."""
    if value is None:
        return None
    try:
        text = _json_value(value)[1]
    except Exception as exc:  # noqa: BLE001 - as in _sent_value
        return json.dumps({"value_error": _unserialisable(value, exc)})
    kept = '{"value":' + text + "}"
    if len(escape_key(kept)) > MAX_NOTE_BYTES:
        return json.dumps({"value_error": (
            f"The first run's value takes {len(text):,} bytes as JSON, more than the {MAX_NOTE_BYTES:,} kept for a "
            "resend's reply; the command is stored. Read the aggregate for its outcome."
        )})
    return kept


def _value_fields(kept: str | None) -> dict[str, Any]:
    """A duplicate's value fields, from what its first run stored (nothing when it stored nothing)."""
    if kept is None:
        return {}
    fields = json.loads(kept)
    return {k: fields[k] for k in ("value", "value_error") if k in fields}


_MAX_MESSAGE = 2000  # an error reply must fit in a message whatever the exception's text


def _fitted(answer: dict[str, Any], limit: int, subject: str) -> bytes:
    """``answer`` as a reply body of at most ``limit`` bytes (the server's max_payload; a reply has no headers).

    A value too large is left out, with a ``value_error`` saying so: the command is stored all the same.
    """
    body = json.dumps(answer).encode()
    if len(body) > limit and "value" in answer:
        answer = {k: v for k, v in answer.items() if k != "value"}
        answer["value_error"] = (
            f"The value takes {len(body):,} bytes in the reply; the server's max_payload allows {limit:,}, so it was "
            "not sent. The command is stored. Return less, or read the aggregate for its outcome."
        )
        log.warning("command on %s (stored): its value is not sent: %s", subject, answer["value_error"])
        body = json.dumps(answer).encode()
    return body


def _error(kind: str, message: str, exc: BaseException | None = None) -> dict[str, Any]:
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return {"ok": False, "error": kind, "message": message, "type": type(exc).__name__ if exc is not None else None}


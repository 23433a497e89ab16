"""Send commands to a :class:`~aggregates.CommandService` over NATS: one awaitable call per command.

::

    client = CommandClient(store.nc)
    reply = await client.send(Account, "alice", Deposit(amount=5))
    reply.version, reply.position, reply.command_id

With routing (the default), a command goes to its aggregate's partition
subject, ``<subject>.<partition>``, where the one worker that owns the
partition keeps the aggregate warm in its cache; the number of partitions is
read from the services' routing bucket (and read again every
:data:`ROUTES_REFRESH_S`). When no worker serves the partition at that moment
(one just died, or the partitions are moving), the command goes to the plain
subject, which every worker serves: nobody had received it, so nothing can
run twice.

Failures raise the same errors as in-process (:class:`~aggregates.DomainError`
as :class:`~aggregates.CommandRejectedError`,
:class:`~aggregates.AggregateNotFoundError`) or a
:class:`~aggregates.CommandError`. Every command carries a command id (a new
one unless given); resending it with the same id is safe: the service runs it
at most once and answers a resend with the first run's version, position and
value. A request larger than the server takes (body and headers together over
its ``max_payload``) raises :class:`~aggregates.InvalidCommandError` before
anything is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import nats.errors
from nats.aio.client import Client as NATS
from pydantic import BaseModel

from eventstore import EventStore, InvalidArgumentError
from eventstore.validation import check_bool, check_seconds
from eventstore.wire import check_metadata, header_block_size

from .aggregate import Aggregate
from .membership import PARTITIONS_KEY, routing_bucket
from .routing import partition_of
from .command_messages import COMMAND_ID_HEADER, CORRELATION_ID_HEADER, check_name, check_prefix, command_subject
from .errors import (
    AggregateExistsError,
    AggregateNotFoundError,
    CommandConflictError,
    CommandError,
    CommandFailedError,
    CommandRejectedError,
    CommandUnavailableError,
    InvalidCommandError,
)

__all__ = ["CommandClient", "CommandReply", "ROUTES_REFRESH_S"]

log = logging.getLogger(__name__)

ROUTES_REFRESH_S = 10.0
"""How long a client trusts the partition count it read (or that there was none) before reading it again."""

_RAISES: dict[str, type[Exception]] = {
    "invalid": InvalidCommandError,
    "conflict": CommandConflictError,
    "unavailable": CommandUnavailableError,
    "failed": CommandFailedError,
}


@dataclass(frozen=True, slots=True)
class CommandReply:
    """A command's success: the aggregate's version and position after it, and the command id it ran under.

    ``duplicate`` is True when the id had run before (nothing new was stored;
    version, position and value are the first run's). ``value`` is what the
    handler returned, as JSON (None when it returned nothing).

    ``value_error`` is None, or says why the handler's value was not sent
    although the command is stored: it is not JSON-serialisable, the reply
    would exceed the server's ``max_payload``, or (for a duplicate) it was
    larger than the service keeps for a resend. ``value`` is then None. The
    command succeeded: do not send it again under a new id.
    """

    version: int
    position: int
    duplicate: bool
    command_id: str
    value: Any = None
    value_error: str | None = None


class CommandClient:
    """Sends commands as NATS requests to ``<subject_prefix>.<Category>.<Command>``.

    Each :meth:`send` ends within its timeout. Safe for many concurrent tasks.
    """

    def __init__(
        self, connection: EventStore | NATS, *, subject_prefix: str = "cmd", timeout_s: float = 5.0, routing: bool = True
    ) -> None:
        # A store that started its own embedded server (no NATS_URL) shares it with nobody: said on NoResponders.
        self._private = isinstance(connection, EventStore) and connection.server is not None
        if isinstance(connection, EventStore):
            connection = connection.nc
        if not isinstance(connection, NATS):
            raise InvalidArgumentError(
                f"CommandClient needs an EventStore or a connected nats-py client, not {connection!r:.80}."
            )
        self._nc = connection
        self.subject_prefix = check_prefix(subject_prefix)
        self.timeout_s = check_seconds("timeout_s", timeout_s, 0.001, 3600.0)
        self.routing = check_bool("routing", routing)
        self._partitions: tuple[int | None, float] = (None, -float("inf"))  # (count or None, read at)
        self._reading: asyncio.Task[int | None] | None = None

    async def send(
        self,
        aggregate: type[Aggregate[Any]] | str,
        aggregate_id: str | UUID,
        command: BaseModel,
        *,
        name: str | None = None,
        command_id: str | None = None,
        correlation_id: str | None = None,
        timeout_s: float | None = None,
    ) -> CommandReply:
        """Send ``command`` for the aggregate ``aggregate_id`` and wait for the service's answer.

        ``aggregate`` is the aggregate class or its category, ``aggregate_id`` a
        ``str`` or a :class:`uuid.UUID`; ``name`` the
        command's name (default: the command's class name). ``command_id``
        (default: a new UUID) makes a resend safe. Raises, without sending,
        :class:`~eventstore.InvalidArgumentError` for arguments that cannot
        make a request and :class:`~aggregates.InvalidCommandError` for a
        request the server would refuse as too large (its header block and
        body together over ``max_payload``; the server would close the
        connection, disturbing every request on it); after sending, the errors
        in the module docs.
        """
        category = check_name(aggregate if isinstance(aggregate, str) else _category(aggregate), "aggregate category")
        aggregate_id = str(aggregate_id) if isinstance(aggregate_id, UUID) else aggregate_id
        if not isinstance(aggregate_id, str) or not aggregate_id:
            raise InvalidArgumentError(f"aggregate_id must be a non-empty str, not {aggregate_id!r:.80}.")
        if not isinstance(command, BaseModel):
            raise InvalidArgumentError(f"A command must be a pydantic model instance, not {command!r:.80}.")
        subject = command_subject(self.subject_prefix, category, check_name(name if name is not None else type(command).__name__))
        command_id = uuid.uuid4().hex if command_id is None else command_id
        check_metadata("command_id", command_id)
        headers = {COMMAND_ID_HEADER: command_id}
        if correlation_id is not None:
            check_metadata("correlation_id", correlation_id)
            headers[CORRELATION_ID_HEADER] = correlation_id
        timeout = self.timeout_s if timeout_s is None else check_seconds("timeout_s", timeout_s, 0.001, 3600.0)
        body = json.dumps({"aggregate_id": aggregate_id, "command": command.model_dump(mode="json")}).encode()
        # The server counts the header block with the body (HPUB's total size) against max_payload; nats-py only
        # the body. The subject and inbox go on the control line, whose own limit our subject names stay under.
        size = header_block_size(headers) + len(body)
        if size > self._nc.max_payload:
            raise InvalidCommandError(self._too_large(subject, size, body))
        try:
            reply = await self._request(subject, aggregate_id, body, timeout, headers)
        except nats.errors.MaxPayloadError as exc:  # the connection moved to a server with a smaller limit
            raise InvalidCommandError(self._too_large(subject, size, body)) from exc
        except nats.errors.NoRespondersError as exc:
            private = (
                " This process talks to a private embedded server that no service can reach (no NATS_URL was set): "
                "run `jetsourcing server` and set NATS_URL on both sides." if self._private else ""
            )
            raise CommandUnavailableError(
                f"No service serves {subject}: start one (CommandService) with this command, or check the subject "
                f"prefix on both sides.{private}"
            ) from exc
        except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
            raise CommandUnavailableError(
                f"No answer to the command on {subject} within {timeout}s: it may or may not have run. Send it "
                f"again with command_id={command_id!r}: it runs at most once."
            ) from exc
        except nats.errors.Error as exc:
            raise CommandUnavailableError(f"Could not send the command on {subject}: {exc}") from exc
        return _answer(subject, category, aggregate_id, command_id, reply.data)

    def _too_large(self, subject: str, size: int, body: bytes) -> str:
        return (
            f"The command to {subject} takes {size:,} bytes as sent ({len(body):,} of body, {size - len(body):,} of "
            f"headers); the NATS server takes at most {self._nc.max_payload:,} per message. Nothing was sent. Send "
            "less in one command, or raise the server's max_payload."
        )


    async def _request(self, subject: str, aggregate_id: str, body: bytes, timeout: float, headers: dict[str, str]) -> Any:
        """The reply from the aggregate's partition subject, or from the plain one when nobody serves the partition.

        Everything here shares the one ``timeout``: reading the partition count, the request, its fallback.
        """
        deadline = time.monotonic() + timeout
        partitions = await self._partition_count(timeout / 2) if self.routing else None
        if partitions is not None:
            try:
                return await self._nc.request(
                    f"{subject}.{partition_of(aggregate_id, partitions)}", body,
                    timeout=max(0.001, deadline - time.monotonic()), headers=headers,
                )
            except nats.errors.NoRespondersError:
                pass  # no worker had the partition: nobody received the command, the plain subject may take it
        return await self._nc.request(subject, body, timeout=max(0.001, deadline - time.monotonic()), headers=headers)

    async def _partition_count(self, wait_s: float) -> int | None:
        """The services' partition count (None: no routing services, or not known yet).

        Read once before the first command (waiting at most ``wait_s``; the commands go on the plain
        subjects meanwhile), then again in the background every :data:`ROUTES_REFRESH_S`, while
        commands use the count they have.
        """
        count, read_at = self._partitions
        if time.monotonic() - read_at < ROUTES_REFRESH_S:
            return count
        if self._reading is None or self._reading.done():  # one read for all the commands that want it
            self._reading = asyncio.ensure_future(self._read_partition_count(2.0))
        if read_at > -float("inf"):
            return count  # known, if old: the read under way refreshes it
        try:
            async with asyncio.timeout(wait_s):  # not wait_for: on 3.11 it can swallow a cancellation
                return await asyncio.shield(self._reading)
        except Exception:  # noqa: BLE001 - a timeout too: without the count the plain subject serves every command
            return count

    async def _read_partition_count(self, timeout: float) -> int | None:
        count: int | None = None
        try:
            kv = await self._nc.jetstream(timeout=timeout).key_value(routing_bucket(self.subject_prefix))
            count = int((await kv.get(PARTITIONS_KEY)).value or b"") or None
        except (nats.errors.Error, asyncio.TimeoutError, ValueError) as exc:
            log.debug("no command routing on %s (plain subjects): %r", self.subject_prefix, exc)
        self._partitions = (count, time.monotonic())
        return count


def _answer(subject: str, category: str, aggregate_id: str, command_id: str, data: bytes) -> CommandReply:
    try:
        answer = json.loads(data)
        if answer["ok"]:
            value_error = answer.get("value_error")
            return CommandReply(
                int(answer["version"]), int(answer["position"]), bool(answer["duplicate"]), command_id,
                answer.get("value"), None if value_error is None else str(value_error),
            )
        kind, message = str(answer["error"]), str(answer["message"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CommandError(f"The answer to the command on {subject} is not a command service's: {data[:200]!r}") from exc
    if kind == "domain":
        raise CommandRejectedError(message, str(answer.get("type") or "DomainError"))
    if kind == "not_found":
        raise AggregateNotFoundError(category, aggregate_id)
    if kind == "exists":
        error = AggregateExistsError(category, aggregate_id)
        error.args = (message,)  # the service's text: it names the version found
        raise error
    raise _RAISES.get(kind, CommandError)(message)


def _category(aggregate: object) -> str:
    if isinstance(aggregate, type) and issubclass(aggregate, Aggregate):
        return aggregate.category
    raise InvalidArgumentError(f"aggregate must be an Aggregate class or a category name, not {aggregate!r:.80}.")

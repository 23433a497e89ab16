"""Durable, acknowledged pull consumers: the JetStream calls reactors (and anything else that acks) make.

:class:`DurableConsumer` holds one named consumer of one stream. Its API calls
(info, create, update, delete) go through the store's :class:`~eventstore.jetstream.inbox.Inbox`,
whose :meth:`~eventstore.jetstream.inbox.Inbox.api` resends a request while JetStream is
between leaders (an election, a stepped-down or lost leader) within its
deadline, then raises :class:`~eventstore.ServerUnavailableError` naming the
operation. JetStream's own refusals come back as :class:`ConsumerAnswer` for the
caller to judge. Pull requests, acknowledgements and the delivered messages
themselves use nats-py's public API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from .inbox import Inbox
from .api import API_PREFIX, ErrorCode, Subjects

__all__ = ["ConsumerAnswer", "DurableConsumer"]

_NS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class ConsumerAnswer:
    """JetStream's answer about a consumer: its info (``config``, ``num_pending``, ...) or its error."""

    info: dict[str, Any]

    @property
    def error(self) -> dict[str, Any] | None:
        """The error JetStream answered with, or None."""
        error = self.info.get("error")
        return error if isinstance(error, dict) else None

    @property
    def code(self) -> int | None:
        """The error's ``err_code`` (see :class:`~eventstore.jetstream.ErrorCode`), or None."""
        return None if self.error is None else self.error.get("err_code")

    @property
    def description(self) -> str:
        """The error's description, for messages ("" without an error)."""
        return "" if self.error is None else str(self.error.get("description", self.error))

    @property
    def not_found(self) -> bool:
        """Whether the consumer does not exist."""
        return self.code == ErrorCode.CONSUMER_NOT_FOUND

    @property
    def stream_not_found(self) -> bool:
        """Whether the stream does not exist."""
        return self.code == ErrorCode.STREAM_NOT_FOUND

    @property
    def exists_already(self) -> bool:
        """Whether a create found the name taken (another client created it at the same moment)."""
        return self.code in (ErrorCode.CONSUMER_EXISTS, ErrorCode.CONSUMER_ALREADY_EXISTS)


class DurableConsumer:
    """One durable consumer ``name`` of ``stream`` (see the module docs); cheap to make, holds no resources."""

    def __init__(
        self, nc: NATS, inbox: Inbox, stream: str, name: str, *, api_timeout_s: float, api_prefix: str = API_PREFIX
    ) -> None:
        self._nc = nc
        self._inbox = inbox
        self.stream = stream
        self.name = name
        self._api_timeout_s = api_timeout_s
        self._subjects = Subjects(stream, api_prefix)

    async def _call(self, subject: str, body: dict[str, object] | None, what: str) -> ConsumerAnswer:
        data = b"" if body is None else json.dumps(body).encode()
        return ConsumerAnswer(await self._inbox.api(subject, data, self._api_timeout_s, what=what))

    async def info(self) -> ConsumerAnswer:
        """The consumer's info (or JetStream's error: :attr:`ConsumerAnswer.not_found`, ...)."""
        return await self._call(
            self._subjects.consumer_info(self.name), None, f"Reading consumer {self.name!r} of stream {self.stream!r}"
        )

    async def create(self, config: dict[str, object]) -> ConsumerAnswer:
        """Create the consumer with ``config`` (its ``durable_name`` and ``name`` are set here); never replaces one."""
        return await self._write(config, "create")

    async def update(self, config: dict[str, object]) -> ConsumerAnswer:
        """Change an existing consumer's editable settings to ``config``'s."""
        return await self._write(config, "update")

    async def _write(self, config: dict[str, object], action: str) -> ConsumerAnswer:
        named = {**config, "durable_name": self.name, "name": self.name}
        body: dict[str, object] = {"stream_name": self.stream, "config": named, "action": action}
        what = f"{action.capitalize()[:-1]}ing consumer {self.name!r} of stream {self.stream!r}"
        return await self._call(self._subjects.consumer_create(self.name), body, what)

    async def delete(self) -> ConsumerAnswer:
        """Delete the consumer (its delivered and acknowledged state goes with it)."""
        return await self._call(
            self._subjects.consumer_delete(self.name), None, f"Deleting consumer {self.name!r} of stream {self.stream!r}"
        )

    async def pull(self, batch: int, expires_s: float, reply: str) -> None:
        """Ask for up to ``batch`` messages, delivered to ``reply`` within ``expires_s`` (a status message ends it)."""
        request = {"batch": batch, "expires": int(expires_s * _NS)}
        await self._nc.publish(self._subjects.consumer_next(self.name), json.dumps(request).encode(), reply=reply)

    def max_deliveries_subject(self) -> str:
        """Where the server announces a message of this consumer that reached ``max_deliver``."""
        return self._subjects.max_deliveries_advisory(self.name)

    async def stored(self, position: int) -> Msg:
        """The stream's message at ``position``, as a direct get answers it (a ``Status`` header: not there)."""
        what = f"Reading position {position} of stream {self.stream!r}"
        (msg,) = await self._inbox.request(
            self._subjects.direct_get(), json.dumps({"seq": position}).encode(), self._api_timeout_s, what=what
        )
        return msg

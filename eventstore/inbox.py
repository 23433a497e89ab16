"""Requests whose answer is a stream of messages ending in a status message (JetStream direct get batch).

nats-py has no helper for these; one wildcard subscription per connection
routes each reply to the request that asked for it, so a request costs one
publish and no SUB/UNSUB round of its own.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from .errors import ServerUnavailableError

__all__ = ["BatchInbox"]


class BatchInbox:
    """Sends requests and collects every reply message up to and including the terminating status message."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._pending: dict[str, tuple[list[Msg], asyncio.Future[list[Msg]]]] = {}
        self._sub: Subscription | None = None
        self._counter = 0
        self._lock = asyncio.Lock()

    async def _ensure_subscribed(self) -> None:
        if self._sub is None:
            async with self._lock:
                if self._sub is None:
                    self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._on_msg, pending_msgs_limit=-1)

    async def _on_msg(self, msg: Msg) -> None:
        token = msg.subject[len(self._prefix) + 1 :]
        entry = self._pending.get(token)
        if entry is None:
            return
        msgs, future = entry
        msgs.append(msg)
        headers = msg.headers
        if headers and "Status" in headers and not future.done():
            future.set_result(msgs)

    async def request(self, subject: str, payload: bytes, timeout_s: float) -> list[Msg]:
        """Publish ``payload`` to ``subject`` and return the replies; the last one is the status message."""
        await self._ensure_subscribed()
        self._counter += 1
        token = str(self._counter)
        future: asyncio.Future[list[Msg]] = asyncio.get_running_loop().create_future()
        self._pending[token] = ([], future)
        try:
            await self._nc.publish(subject, payload, reply=f"{self._prefix}.{token}")
            return await asyncio.wait_for(future, timeout_s)
        except (asyncio.TimeoutError, NatsError):
            raise ServerUnavailableError(
                f"No complete answer to {subject} within {timeout_s}s. Check that the NATS server is "
                "running and reachable, or raise request_timeout_s."
            ) from None
        finally:
            self._pending.pop(token, None)

    async def close(self) -> None:
        """Drop the subscription; pending requests fail with their timeout."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                pass

"""Request/reply over one wildcard subscription per connection.

nats-py's ``request`` creates a future and an ``asyncio.wait_for`` per call,
and has no helper for requests answered by a stream of messages (JetStream
direct get batch). :class:`Inbox` serves both: every reply subject is
``<inbox>.<token>``, one subscription callback routes replies to the waiting
request, and one sweeper task fails requests that got no answer in time
(thousands of pipelined appends would otherwise keep thousands of timers in
the event loop's heap).
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionClosedError
from nats.errors import Error as NatsError

from ..errors import (
    EventStoreClosedError,
    EventStoreError,
    ServerUnavailableError,
    not_now_answer,
    server_unavailable,
    store_closed,
)
from ..wire import Header
from .api import TRANSIENT_API_ERRORS

__all__ = ["Inbox", "TRANSIENT_API_ERRORS"]



class Inbox:
    """Sends requests on one connection and routes their replies back."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._cut = len(self._prefix) + 1
        # token -> (messages so far, future, wants many messages, deadline)
        self._pending: dict[str, tuple[list[Msg], asyncio.Future[list[Msg]], bool, float]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        self._counter = 0
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the store was closed)."""
        return self._closed

    def _failed(self, what: str, timeout_s: float, exc: BaseException) -> EventStoreError:
        """The error of a request that failed with nats-py's ``exc``: a closed store's, or an unavailable server's."""
        if self._closed and isinstance(exc, ConnectionClosedError):
            return store_closed(what)
        return server_unavailable(what, timeout_s, exc)

    async def _ensure_subscribed(self) -> None:
        if self._sub is None:
            async with self._lock:
                if self._sub is None:
                    self._sub = await self._nc.subscribe(
                        f"{self._prefix}.*", cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1
                    )

    async def _on_msg(self, msg: Msg) -> None:
        entry = self._pending.get(msg.subject[self._cut :])
        if entry is None:
            return
        msgs, future, many, _ = entry
        if future.done():
            # A second answer to one request (during a JetStream leader election more than one server may answer
            # an API request): the caller already holds the list, which must not grow under it.
            return
        msgs.append(msg)
        if not many or (msg.headers and Header.STATUS in msg.headers):
            future.set_result(msgs)

    async def request(
        self,
        subject: str,
        payload: bytes,
        timeout_s: float,
        *,
        what: str,
        headers: dict[str, str] | None = None,
        many: bool = False,
    ) -> list[Msg]:
        """Publish and wait for the reply (``many=False``) or for every reply up to a status message.

        Ends within about ``timeout_s``; without an answer (or with the
        connection closed) raises :class:`ServerUnavailableError` naming the
        operation ``what`` ("Reading Account/42"), not the subject. When the
        inbox is closed (the store closes), before or while it waits, it raises
        :class:`~eventstore.EventStoreClosedError` at once.
        """
        if self._closed:
            raise store_closed(what)
        try:
            await self._ensure_subscribed()
        except NatsError as exc:  # the connection is closed
            raise self._failed(what, timeout_s, exc) from exc
        self._counter += 1
        token = str(self._counter)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Msg]] = loop.create_future()
        self._pending[token] = ([], future, many, loop.time() + timeout_s)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep(min(timeout_s / 4, 0.25)))
        try:
            await self._nc.publish(subject, payload, reply=f"{self._prefix}.{token}", headers=headers)
            return await future
        except EventStoreClosedError:
            raise store_closed(what) from None
        except (asyncio.TimeoutError, NatsError) as exc:
            raise self._failed(what, timeout_s, exc) from exc
        finally:
            del self._pending[token]

    async def api(self, subject: str, body: bytes, timeout_s: float, *, what: str) -> dict[str, Any]:
        """A JetStream API request and its JSON answer, resent while JetStream is between leaders.

        A clustered JetStream drops API requests until its meta group has a
        leader, answers nothing (503) for a stream without a leader, and says
        "not now" (:data:`TRANSIENT_API_ERRORS`: temporarily unavailable, no
        suitable peers, offline) meanwhile: each try waits a quarter of
        ``timeout_s`` (at least 0.5 s), and tries are repeated with jittered
        backoff until ``timeout_s`` has passed. Then
        :class:`ServerUnavailableError` names the operation ``what`` (and quotes
        the last "not now", if any). Other errors in the answer are returned,
        for the caller to judge.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        step = 0.05
        refused: dict[str, Any] | None = None  # the last "not now" answer
        while True:
            left = deadline - loop.time()
            try:
                (reply,) = await self.request(subject, body, max(0.05, min(left, max(0.5, timeout_s / 4))), what=what)
            except ServerUnavailableError as exc:
                if self._nc.is_closed or deadline - loop.time() <= 0.05:
                    # Said in terms of the whole wait (the try's own timeout was shorter).
                    raise server_unavailable(what, timeout_s, exc.__cause__ or exc) from exc
            else:
                if reply.data:
                    try:
                        answer: dict[str, Any] = json.loads(reply.data)
                    except ValueError as exc:
                        raise ServerUnavailableError(
                            f"{what}: the server's answer is not JSON ({exc}). Is this a NATS server with JetStream "
                            "enabled (-js)?"
                        ) from exc
                    error = answer.get("error") or {}
                    if error.get("err_code") not in TRANSIENT_API_ERRORS:
                        return answer
                    refused = error
            left = deadline - loop.time()
            if left <= 0:
                if refused is not None:
                    raise not_now_answer(what, refused.get("description"), refused.get("err_code"))
                raise ServerUnavailableError(
                    f"{what}: JetStream gave no answer within {timeout_s}s (it is electing a leader, or too few of "
                    "its servers are up for a quorum, or it is not enabled: start the server with -js)."
                )
            await asyncio.sleep(min(left, random.uniform(step / 2, step)))
            step = min(step * 2, 1.0)

    async def request_each(self, subject: str, payloads: list[bytes], timeout_s: float, *, what: str) -> list[Msg]:
        """Publish every payload as a request, then wait for each one's reply (pipelined: one round trip for all,
        without a task per request); the replies in the payloads' order. Ends and fails as :meth:`request` does."""
        if self._closed:
            raise store_closed(what)
        try:
            await self._ensure_subscribed()
        except NatsError as exc:
            raise self._failed(what, timeout_s, exc) from exc
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        tokens: list[str] = []
        futures: list[asyncio.Future[list[Msg]]] = []
        for _ in payloads:
            self._counter += 1
            tokens.append(str(self._counter))
            futures.append(loop.create_future())
            self._pending[tokens[-1]] = ([], futures[-1], False, deadline)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep(min(timeout_s / 4, 0.25)))
        try:
            for token, payload in zip(tokens, payloads):
                await self._nc.publish(subject, payload, reply=f"{self._prefix}.{token}")
            return [(await future)[0] for future in futures]
        except EventStoreClosedError:
            raise store_closed(what) from None
        except (asyncio.TimeoutError, NatsError) as exc:
            raise self._failed(what, timeout_s, exc) from exc
        finally:
            for token, future in zip(tokens, futures):
                del self._pending[token]
                if future.done() and not future.cancelled():
                    future.exception()  # failed by a sweep or a close after an earlier one: nothing else will look

    async def _sweep(self, every_s: float) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            await asyncio.sleep(every_s)
            now = loop.time()
            for _, future, _, deadline in list(self._pending.values()):
                if deadline <= now and not future.done():
                    future.set_exception(asyncio.TimeoutError())

    async def close(self) -> None:
        """Fail every request still waiting, at once, with :class:`~eventstore.EventStoreClosedError` (as every
        later one), and drop the subscription."""
        self._closed = True
        closed = EventStoreClosedError("The event store was closed.")  # each request says it in its own terms
        for _, future, _, _ in self._pending.values():
            if not future.done():
                future.set_exception(closed)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                pass


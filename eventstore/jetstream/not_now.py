"""Waiting out a JetStream that says "not now": the one retry of the API calls a process makes to start.

While a clustered JetStream elects a leader (of its meta group, of a stream,
of a consumer) it drops API requests, or answers one of
:data:`~eventstore.jetstream.TRANSIENT_API_ERRORS` (temporarily unavailable,
no suitable peers for placement, peer or stream offline); nothing was done,
and the same request succeeds once the election is over (about 5-10 s after
a meta leader is lost). A request whose reply was lost on the network looks
the same. Creating or checking a stream, a durable consumer or a key-value
bucket at start-up is idempotent, so :func:`ride_out_jetstream` simply does
it again: every attempt has a client-side deadline, attempts back off, and
the wait is logged by state (:func:`eventstore.ride_out`), for as long as
the caller allows:

* a long-running process (daemon, rebuild, reactor, ``serve``) passes its
  outage policy, ``EventStoreSettings.outage_limit_s`` (None: for ever),
  and its stop event, so a stop ends the wait at once;
* a one-shot call passes ``limit_s=0``: one attempt, which still rides out a
  short election within its requests' deadlines (:meth:`Inbox.api
  <eventstore.jetstream.inbox.Inbox.api>` resends "not now" answers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.errors import ConnectionClosedError

from ..errors import AuthenticationError, ServerUnavailableError, StorageError, map_nats_error, server_unavailable
from ..tasks import ride_out, stop_task

__all__ = ["not_now", "ride_out_jetstream"]

T = TypeVar("T")


class _Stopped(ServerUnavailableError):
    """The caller's stop event was set while an attempt waited for JetStream."""


def not_now(exc: BaseException) -> bool:
    """Whether ``exc`` means "not now": the server did not answer in time, or answered that it cannot act yet.

    True for :class:`~eventstore.ServerUnavailableError` (nats-py's errors map
    to it through :func:`~eventstore.errors.map_nats_error`), except the ones
    that asking again cannot cure: rejected credentials
    (:class:`~eventstore.AuthenticationError`), full or failing storage
    (:class:`~eventstore.StorageError`) and a connection that was closed.
    """
    if not isinstance(exc, ServerUnavailableError) or isinstance(exc, (AuthenticationError, StorageError, _Stopped)):
        return False
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionClosedError):
            return False
        cause = cause.__cause__
    return True


async def ride_out_jetstream(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    logger: logging.Logger,
    timeout_s: float,
    requests: int = 1,
    limit_s: float | None,
    stop: asyncio.Event | None = None,
) -> T:
    """``await call()`` until it succeeds, waiting out the "not now" failures of :func:`not_now` (module docs).

    ``call`` is one idempotent attempt: up to ``requests`` JetStream API
    requests, each with a deadline of ``timeout_s`` of its own. The whole
    attempt is bounded client-side too (``requests * timeout_s`` and a
    second), so every attempt ends. Its nats-py errors are translated by
    :func:`~eventstore.errors.map_nats_error` (naming ``what``). A "not now"
    is retried with backoff, logged by state, until it has lasted ``limit_s``
    seconds (None: for ever; 0: never retried, nothing logged) or ``stop`` is
    set (which also ends an attempt in flight); then the last failure is
    raised, a :class:`~eventstore.ServerUnavailableError`. Any other failure
    is raised at once.
    """
    attempt_s = requests * timeout_s + 1.0

    async def attempt() -> T:
        with map_nats_error(what, timeout_s):
            if stop is None:
                async with asyncio.timeout(attempt_s):
                    return await call()
            return await _until_stopped(call, stop, what, attempt_s)

    if limit_s == 0:
        return await attempt()
    return await ride_out(attempt, what=what, logger=logger, transient=not_now, limit_s=limit_s, stop=stop)


async def _until_stopped(call: Callable[[], Awaitable[T]], stop: asyncio.Event, what: str, attempt_s: float) -> T:
    """``call()`` within ``attempt_s``, abandoned (cancelled until it ends) as soon as ``stop`` is set."""
    if stop.is_set():
        raise _Stopped(f"{what}: stopped before JetStream answered.")
    task = asyncio.ensure_future(call())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, timeout=attempt_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            await stop_task(task, timeout_s=1.0)  # also when the caller is cancelled
    if not task.cancelled() and task.done():
        return task.result()
    if stop.is_set():
        raise _Stopped(f"{what}: stopped before JetStream answered.")
    raise server_unavailable(what, attempt_s, TimeoutError())

"""Background tasks that always stop, and retry loops that back off.

Why a helper: on Python 3.11 a task can lose a cancellation. ``asyncio.wait_for``
(which nats-py uses inside every request) returns the answer instead of raising
``CancelledError`` when the answer and the cancellation arrive together, so a
loop that relies on one ``task.cancel()`` to end may run on forever, and
whoever awaits it hangs. :func:`stop_task` asks first (the task's own stop flag),
then cancels, re-sending the cancellation until the task ends, and waits a
bounded time in all. :class:`Backoff` gives a retry loop growing, jittered
delays; :class:`Outage` logs a failure once when it starts, then a reminder
now and then, and once when it ends, instead of a line per attempt.
:func:`ride_out` is the outage policy of every long-running process: a call
to a dependency that is unreachable, restarting or silent is retried with
:class:`Backoff`, logged by :class:`Outage`, for as long as the operator
allows (``EventStoreSettings.outage_limit_s``; by default, for ever).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["Backoff", "Outage", "ride_out", "stop_task"]

T = TypeVar("T")

log = logging.getLogger("eventstore")

_RESEND_S = 0.05


async def stop_task(task: asyncio.Future[Any], *, timeout_s: float, grace_s: float = 0.0) -> bool:
    """End ``task`` within about ``timeout_s`` seconds; True if it has ended.

    Waits up to ``grace_s`` for it to end by itself (set its stop flag first),
    then cancels it, and sends the cancellation again every 50 ms while it
    runs, so a task that swallowed one still ends. It never waits longer than
    ``timeout_s`` in all: False means the task ignores cancellation altogether
    (logged as an error with the task's name). The task's own outcome is
    consumed, never raised. If the caller is cancelled meanwhile, the task is
    cancelled too and the caller's cancellation propagates.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        if grace_s > 0 and not task.done():
            await asyncio.wait({task}, timeout=min(grace_s, timeout_s))
        while not task.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
                log.error("Task %r did not end within %.1f s of being cancelled; leaving it.", name, timeout_s)
                return False
            task.cancel()
            await asyncio.wait({task}, timeout=min(_RESEND_S, remaining))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.cancelled():
        task.exception()  # retrieved: asyncio does not report it as "never retrieved"
    return True


class Outage:
    """Logs a failing operation by state, not by attempt: a warning when it starts failing, a reminder every
    ``remind_s`` seconds while it goes on (debug lines otherwise), and one line when it works again."""

    def __init__(self, what: str, logger: logging.Logger, *, remind_s: float = 60.0) -> None:
        self.what = what
        self.log = logger
        self.remind_s = remind_s
        self._since: float | None = None
        self._reminded = 0.0
        self._failures = 0

    @property
    def failing(self) -> bool:
        """True between a failure and the next success."""
        return self._since is not None

    def failed(self, exc: BaseException | str) -> None:
        """Record a failed attempt."""
        now = time.monotonic()
        self._failures += 1
        reason = str(exc) or type(exc).__name__
        if self._since is None:
            self._since = self._reminded = now
            self.log.warning("%s failed (%s); retrying.", self.what, reason)
        elif now - self._reminded >= self.remind_s:
            self._reminded = now
            self.log.warning("%s still failing after %.0f s and %d attempts (%s); retrying.", self.what,
                             now - self._since, self._failures, reason)
        else:
            self.log.debug("%s failed again (%s).", self.what, reason)

    def succeeded(self) -> None:
        """Record a success; after failures, log once that ``what`` works again."""
        if self._since is not None:
            self.log.info("%s works again after %.1f s (%d failed attempts).", self.what,
                          time.monotonic() - self._since, self._failures)
        self._since = None
        self._failures = 0


class Backoff:
    """Delays for one retry loop: exponential from ``first_s`` to ``cap_s``, each drawn between half and all of
    the current step (jitter, so many clients do not retry in step); failures logged by :class:`Outage`.
    """

    def __init__(
        self, what: str, logger: logging.Logger, *, first_s: float = 0.1, cap_s: float = 5.0, remind_s: float = 60.0
    ) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.outage = Outage(what, logger, remind_s=remind_s)
        self._step = first_s

    def failed(self, exc: BaseException | str) -> float:
        """Record a failed attempt; return how long to wait before the next one."""
        self.outage.failed(exc)
        delay = random.uniform(self._step / 2, self._step)
        self._step = min(self._step * 2, self.cap_s)
        return delay

    def succeeded(self) -> None:
        """Record a success: the next failure starts again from ``first_s`` (and is logged)."""
        self.outage.succeeded()
        self._step = self.first_s


async def ride_out(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    logger: logging.Logger,
    transient: Callable[[BaseException], bool],
    limit_s: float | None,
    stop: asyncio.Event | None = None,
    first_s: float = 0.1,
    cap_s: float = 5.0,
) -> T:
    """``await call()`` until it returns, waiting out the failures ``transient`` accepts (the outage policy).

    Each failure is followed by a :class:`Backoff` delay and logged by state
    (:class:`Outage`: one warning when the outage starts, a reminder each
    minute, one line when it ends). ``call`` must bound its own wait (a
    client-side deadline), so every attempt ends. The last failure is raised
    as it is when it is not transient, when the outage has lasted
    ``limit_s`` seconds (None: never), or when ``stop`` is set (checked
    during each delay, so a stop is never held up by a backoff).
    """
    backoff = Backoff(what, logger, first_s=first_s, cap_s=cap_s)
    started: float | None = None
    while True:
        try:
            result = await call()
        except Exception as exc:
            if not transient(exc):
                raise
            now = time.monotonic()
            started = now if started is None else started
            if limit_s is not None and now - started >= limit_s:
                logger.error("%s failed for %.0f s, the outage limit (outage_limit_s); giving up: %s", what,
                             now - started, str(exc) or type(exc).__name__)
                raise
            delay = backoff.failed(exc)
            if limit_s is not None:
                delay = min(delay, max(0.0, started + limit_s - now))
            if stop is None:
                await asyncio.sleep(delay)
            else:
                try:
                    async with asyncio.timeout(delay):
                        await stop.wait()
                except TimeoutError:
                    pass
                if stop.is_set():
                    raise exc
            continue
        backoff.succeeded()
        return result

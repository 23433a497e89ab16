"""Running a command until SIGINT/SIGTERM, with a stop that always ends: :class:`SignalShutdown`.

Used by ``jetsourcing run`` (:func:`projections.daemon.run_daemon`) and ``jetsourcing rebuild``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["SignalShutdown"]

log = logging.getLogger("projections")

T = TypeVar("T")

_FORCED_EXIT_AFTER_S = 3.0
"""How long cancelled work (or the event loop's clean-up) may take before the process exits without it."""
_RECANCEL_S = 0.25


class SignalShutdown:
    """Runs a command's coroutine in a new event loop; SIGINT/SIGTERM stop it in three steps that always end.

    1. The first signal calls ``stop`` (the command finishes its work in hand).
    2. A second signal, or ``timeout_s`` after the first without the command
       ending, cancels it, re-sending the cancellation until it ends (one can
       be lost, see :mod:`eventstore.tasks`); :meth:`run` then raises
       ``CancelledError`` and :attr:`exit_code` is 128 + the signal's number.
    3. If the cancelled command, or the event loop's clean-up after any end
       (it waits for every task left), has not finished 3 s later, the process
       exits at once (``os._exit``) with :attr:`exit_code`. After a signal this
       holds until the process has exited (a thread left running, a store call
       stuck on a frozen server, never keeps it alive); without one, the timer
       is cancelled once :meth:`run` returns, and the caller goes on.
    """

    def __init__(self, stop: Callable[[], None], timeout_s: float) -> None:
        self.stop = stop
        self.timeout_s = timeout_s
        self.signals = 0
        self.first_signal: signal.Signals | None = None
        self.exit_code = 1
        self.forced = False
        self._task: asyncio.Task[Any] | None = None
        self._exits: list[threading.Timer] = []

    def run(self, main: Coroutine[Any, Any, T], *, exit_code: Callable[[T], int] = lambda _: 0) -> T:
        """``asyncio.run(main)`` with the signals handled; ``exit_code`` of its result is the code of a forced exit
        during the loop's clean-up (1 if it raised)."""

        async def guarded() -> T:
            self._task = asyncio.current_task()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.add_signal_handler(sig, self._on_signal, sig)
            try:
                result = await main
            except Exception:
                self.exit_code = 1
                self._exit_later()
                raise
            if not self.forced:
                self.exit_code = exit_code(result)
            self._exit_later()
            return result

        try:
            return asyncio.run(guarded())
        except asyncio.CancelledError:
            log.warning("Stopped by cancellation: the work in hand was rolled back.")
            raise
        finally:
            if not self.signals:
                for timer in self._exits:
                    timer.cancel()

    def _on_signal(self, sig: signal.Signals) -> None:
        self.signals += 1
        self.first_signal = self.first_signal or sig
        self.exit_code = 128 + sig.value
        if self.signals > 1:
            self._force(f"Received {sig.name} again")
            return
        log.info("Received %s: finishing the work in hand and stopping (within %.0f s; send it again to stop at "
                 "once).", sig.name, self.timeout_s)
        self.stop()
        asyncio.get_running_loop().call_later(
            self.timeout_s, self._force, f"The stop did not complete within {self.timeout_s:.0f} s"
        )

    def _force(self, reason: str) -> None:
        if self.forced or self._task is None or self._task.done():
            return
        self.forced = True
        log.warning("%s: cancelling the work in hand.", reason)
        self._cancel()
        self._exit_later()

    def _cancel(self) -> None:
        # Re-sent: a task can swallow a cancellation (see eventstore.tasks).
        if self._task is not None and not self._task.done():
            self._task.cancel()
            asyncio.get_running_loop().call_later(_RECANCEL_S, self._cancel)

    def _exit_later(self) -> None:
        # A thread, not the loop: it must fire after the loop has closed (asyncio.run's clean-up, the exit).
        timer = threading.Timer(_FORCED_EXIT_AFTER_S, self._exit_now)
        timer.daemon = True
        timer.start()
        self._exits.append(timer)

    def _exit_now(self) -> None:
        log.error("The process did not end within %.0f s: exiting now.", _FORCED_EXIT_AFTER_S)
        logging.shutdown()
        os._exit(self.exit_code)

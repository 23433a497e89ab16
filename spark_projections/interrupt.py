"""Ctrl-C and SIGTERM in a ``jetsourcing spark`` command: one line, exit 130 / 143, at once.

PySpark's own Ctrl-C handler cancels the jobs through the py4j connection the interrupted call is
still using, then raises ``KeyboardInterrupt`` inside it: some sixty lines of py4j tracebacks,
and seconds of Spark shutting down after them. :class:`ExitOnSignal` replaces it while a
command runs: the process says its line, asks the JVM it runs to stop (SIGTERM: Spark's shutdown
hooks cancel the jobs and remove its temporary files), waits for it a moment (:data:`JVM_STOP_S`)
and exits; the JVM finishes its shutdown alone if it needs longer. Nothing else reaches the
terminal after the line: what the dying JVM and the interrupted call print then is about the
stop itself. A JVM still starting is not waited for: it exits by itself once up, when it finds
this process gone (unwinding PySpark's start instead would remove the file through which that
JVM reports it is up, and it would wait for ever).

A Delta commit is all or nothing, so an interrupted ``rebuild`` or ``update`` leaves each table
at a whole commit (its last one, or, for a commit under way, the new one), never half-written; it
reports nothing as done that was not (the per-table lines are printed only once every table is
committed). Running the command again brings the tables up to date.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, NoReturn

from spark_projections.session import jvm_process

__all__ = ["JVM_STOP_S", "ExitOnSignal"]

JVM_STOP_S = 1.0
"""How long a command interrupted with a JVM running waits for that JVM to exit before it exits itself."""

_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class ExitOnSignal:
    """While the block runs (in the main thread), SIGINT and SIGTERM end the command as the module docs say.

    ``outcome`` completes the line, e.g. ``"the Delta tables keep their last whole commit; run it again"``.
    :meth:`arm` installs the handlers again after something replaced them (PySpark's context, when it starts,
    installs its own for SIGINT). Elsewhere than in the main thread, nothing is installed.
    """

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> ExitOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.getsignal(sig) for sig in _NAMES}
            self.arm()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def arm(self) -> None:
        """(Re)install the handlers, if the block runs in the main thread."""
        if self._previous:
            for sig in _NAMES:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> NoReturn:
        _exit_stopping(f"jetsourcing: stopped by {_NAMES[signal.Signals(signum)]}: {self.outcome}", 128 + signum)


def _exit_stopping(line: str, code: int) -> NoReturn:
    try:
        sys.stdout.flush()  # the lines printed so far (a print this signal interrupted may be cut)
    except (OSError, RuntimeError, ValueError):
        pass
    os.write(2, f"{line}\n".encode())
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    jvm = jvm_process()
    if jvm is not None:
        jvm.terminate()
        try:
            jvm.wait(JVM_STOP_S)
        except subprocess.TimeoutExpired:  # it goes on with its shutdown hooks alone
            pass
    os._exit(code)

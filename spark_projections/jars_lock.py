"""One resolution of jars through Ivy at a time per Ivy directory, across processes.

Ivy does not lock its cache: two JVMs that start at the same time on an empty cache download the
same files into the same places, and one of them reads the other's half-written file ("Downloaded
file size (0) doesn't match expected Content Length") and fails to start. :func:`resolution_lock`
serialises the JVM starts of jetsourcing's processes that resolve through the same Ivy directory
with an advisory lock (``flock``) on a file in it. The lock is released when its holder releases
it or exits, whatever the way (a killed process holds nothing); the JVM being started holds it too
(:attr:`ResolutionLock.fd` is handed to it), so a JVM that outlives an interrupted start (Ctrl-C
while it downloads) still resolves alone. A process that waits says so in the log, with who holds the lock, and gives up
with :class:`~spark_projections.errors.DeltaJarsUnavailableError` (``resolution_busy``) after
``timeout_s``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from spark_projections.errors import DeltaJarsUnavailableError

__all__ = ["LOCK_FILE", "RESOLUTION_WAIT_S", "ResolutionLock", "ivy_directory", "resolution_lock"]

logger = logging.getLogger(__name__)

LOCK_FILE = ".jetsourcing-resolution.lock"
"""The lock file :func:`resolution_lock` takes, in the Ivy directory."""

RESOLUTION_WAIT_S = 900.0
"""How long a process waits for another one's resolution by default: a first download of the Delta jars
(some 90 MB) on a slow line, with room to spare."""


def ivy_directory(conf: dict[str, str]) -> Path:
    """The Ivy directory a JVM started with Spark configuration ``conf`` resolves jars in: ``spark.jars.ivy``, else
    Spark 4's default ``~/.ivy2.5.2``."""
    return Path(conf.get("spark.jars.ivy") or Path.home() / ".ivy2.5.2").expanduser()


@dataclass(frozen=True)
class ResolutionLock:
    """A held :func:`resolution_lock`: ``fd`` is the locked file's descriptor (pass it to the JVM being started so
    that it holds the lock as long as it lives, see the module docs); ``waited_s`` how long it took to get it."""

    fd: int
    waited_s: float


@contextlib.contextmanager
def resolution_lock(ivy_dir: Path, *, timeout_s: float = RESOLUTION_WAIT_S) -> Iterator[ResolutionLock]:
    """Hold the lock of ``ivy_dir`` for the duration of the block (see the module docs).

    Waits for another holder at most ``timeout_s``, logging a warning when the wait starts (naming the
    holder's pid and the directory); then raises :class:`DeltaJarsUnavailableError` (``resolution_busy``).
    A signal handler that raises interrupts the wait. The directory is created if needed.
    """
    ivy_dir.mkdir(parents=True, exist_ok=True)
    path = ivy_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started = time.monotonic()
        _acquire(fd, path, started + timeout_s, timeout_s)
        waited = time.monotonic() - started
        # Who holds it, for the message of a process that waits (best effort: the lock is the flock).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield ResolutionLock(fd, waited)
        except Exception:
            fcntl.flock(fd, fcntl.LOCK_UN)
            raise
        # An interruption (KeyboardInterrupt, a signal's exception) leaves the lock to the JVM being started with
        # it, if one is, until that JVM exits: it may still be downloading. Otherwise, released for every copy of
        # the descriptor, the JVM's too.
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, path: Path, deadline: float, timeout_s: float) -> None:
    warned = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if warned:
                logger.warning("The other resolution is over: going on.")
            return
        except BlockingIOError:
            pass
        if not warned:
            logger.warning(
                "Another process (%s) is resolving jars in %s (the first start on this machine downloads the Delta "
                "jars); waiting for it, %.0fs at most, so that the two do not write the same files.",
                _holder(fd), path.parent, timeout_s,
            )
            warned = True
        if time.monotonic() >= deadline:
            raise DeltaJarsUnavailableError(
                "resolution_busy",
                f"Another process ({_holder(fd)}) has been resolving jars in {path.parent} for more than "
                f"{timeout_s:.0f}s. Let it finish (or stop it), then start again; to resolve elsewhere, set "
                "spark.jars.ivy in JETSOURCING_SPARK_EXTRA_CONF to another folder.",
            )
        time.sleep(0.2)


def _holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "pid unknown"

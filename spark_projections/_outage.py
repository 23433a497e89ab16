"""The outage policy inside Spark's Python workers: what counts as an outage, how long it is waited out, what
giving up says, and where the state lines go.

The policy is the daemon's (:func:`eventstore.ride_out`, ``EventStoreSettings.outage_limit_s``): a NATS
server that is unreachable, restarting or silent is retried with backoff, logged once when the outage
starts, each minute while it lasts and once when it ends, for ``outage_limit_s`` seconds (None: for ever).
The source's planner and partition readers run in processes Spark starts (never the driver's Python), so
the limit reaches them as the ``outage_limit_s`` option and their lines go to the worker's stderr, which
Spark forwards to its own.
"""

from __future__ import annotations

import logging
import sys
import time

from eventstore import AuthenticationError, Backoff, ServerUnavailableError
from spark_projections.errors import EventSourceError

log = logging.getLogger("spark_projections.source")


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (or the error an :class:`EventSourceError` wraps) is a lost, restarting or silent server,
    which waiting can cure; refused credentials or TLS cannot be."""
    cause = exc.__cause__ if isinstance(exc, EventSourceError) else exc
    return isinstance(cause, ServerUnavailableError) and not isinstance(cause, AuthenticationError)


def parse_limit(text: str | None) -> float | None:
    """The ``outage_limit_s`` option: seconds > 0, or None (absent, empty or ``none``: wait for ever)."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    try:
        limit = float(text)
    except ValueError:
        limit = 0.0
    if not 0 < limit < float("inf"):
        raise EventSourceError(
            f"Option 'outage_limit_s' must be a positive number of seconds, or 'none' to wait for ever; not {text!r}."
        )
    return limit


def gave_up(exc: BaseException, limit_s: float) -> EventSourceError:
    """The error that ends a read at the outage limit: the server's failure first, then the limit. Raise it
    ``from exc``."""
    cause = exc.__cause__ if isinstance(exc, EventSourceError) and exc.__cause__ is not None else exc
    return EventSourceError(
        f"{str(cause).rstrip('.')}; the outage reached its limit of {limit_s:g}s (outage_limit_s, "
        "JETSOURCING_OUTAGE_LIMIT_S). Start the servers, or raise the limit (unset, it waits for ever)."
    )


class OutageAcrossCalls:
    """The outage policy for a call Spark makes again and again and that must not block (the planner's
    ``latestOffset``): each failure is logged by state and sets when the next try is due; at the limit,
    :meth:`failed` raises :func:`gave_up`'s error."""

    def __init__(self, what: str, limit_s: float | None) -> None:
        self.limit_s = limit_s
        self._backoff = Backoff(what, worker_logger())
        self._what = what
        self._since: float | None = None
        self._due = 0.0

    @property
    def due(self) -> bool:
        """Whether the next try is due (its backoff delay has passed)."""
        return time.monotonic() >= self._due

    def failed(self, exc: BaseException) -> None:
        """Record a failed try; raise :func:`gave_up`'s error when the outage reached ``limit_s``."""
        now = time.monotonic()
        self._since = now if self._since is None else self._since
        if self.limit_s is not None and now - self._since >= self.limit_s:
            worker_logger().error("%s failed for %.0f s, the outage limit (outage_limit_s); giving up: %s",
                                  self._what, now - self._since, exc)
            raise gave_up(exc, self.limit_s) from exc
        delay = self._backoff.failed(exc)
        if self.limit_s is not None:
            delay = min(delay, self._since + self.limit_s - now)
        self._due = now + delay

    def succeeded(self) -> None:
        """Record a success (after failures, one line says the server works again)."""
        self._backoff.succeeded()
        self._since = None
        self._due = 0.0


def worker_logger() -> logging.Logger:
    """This module's logger, writing to stderr when nothing in this process set up logging (a Spark worker):
    Python's last-resort handler would drop the line that says the outage ended."""
    root = logging.getLogger()
    if not log.handlers and not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))  # the CLI's
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log

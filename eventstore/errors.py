"""Errors raised by the event store.

Every error the package raises derives from :class:`EventStoreError`, and says
what was wrong and what to do about it::

    EventStoreError
    ├── InvalidArgumentError      a call's argument has the wrong type or value (also TypeError, ValueError)
    │   └── UncheckableQueryError a DCB append condition's query has a shape the server cannot check
    ├── ConcurrencyError          an append's expected version did not hold
    ├── AppendConditionError      a DCB append's condition failed: a matching event was stored after it read
    ├── InvalidStreamIdError      a category or entity id cannot name a stream
    ├── InvalidEventError         an event cannot be stored (bad type name, empty append, ...)
    │   └── EventTooLargeError    a commit exceeds the server's max payload
    ├── UnknownEventTypeError     a stored event's type is not registered
    ├── EventDecodeError          a stored payload does not validate against its model
    │   └── HistoryGapError       an entity's stored commits do not run 1, 2, 3, ...: some are missing or forged
    ├── ServerUnavailableError    the server cannot be reached or did not answer in time
    │   ├── AuthenticationError   the server rejected the credentials, or TLS failed: retrying cannot help
    │   └── StorageError          the server answers but cannot store: its storage is full, at its limit or failing
    ├── StreamConfigError         the stream exists with settings unfit for an event store
    ├── EventStoreClosedError     the event store was closed: a call in flight or made later ends at once
    └── ImportPathError           user code named as ``module:attr`` cannot be imported (also ImportError)

Backend errors (nats-py exceptions, JetStream ``err_code`` values) are turned
into these at one boundary, :class:`~.sending.Sender`'s reply handling and
:func:`map_nats_error`, always with ``raise ... from exc``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import Error as NatsError
from nats.js.errors import APIError, ServiceUnavailableError

if TYPE_CHECKING:
    from .streams import StreamId

__all__ = [
    "AppendConditionError",
    "AuthenticationError",
    "ConcurrencyError",
    "EventDecodeError",
    "EventStoreClosedError",
    "EventStoreError",
    "EventTooLargeError",
    "HistoryGapError",
    "ImportPathError",
    "InvalidArgumentError",
    "InvalidEventError",
    "InvalidStreamIdError",
    "ServerUnavailableError",
    "StorageError",
    "StreamConfigError",
    "UncheckableQueryError",
    "UnknownEventTypeError",
    "map_nats_error",
    "not_now_answer",
    "server_unavailable",
    "store_closed",
]


class EventStoreError(Exception):
    """Base of every error raised by :mod:`eventstore`."""


class ImportPathError(EventStoreError, ImportError):
    """User code named by import path (``module:attr``, as command lines take it) cannot be imported."""


class InvalidArgumentError(EventStoreError, TypeError, ValueError):
    """An argument of a public call has the wrong type or value; raised before anything is sent.

    The message names the argument, the value given and what is allowed. It is
    both a :class:`TypeError` and a :class:`ValueError`, so code that catches
    either keeps working.
    """


class ConcurrencyError(EventStoreError):
    """The entity's version was not the one the append expected; nothing of the append was stored.

    ``expected`` is what the caller expected (an int, ``"no stream"`` or ``"any"``),
    ``actual`` the entity's version on the server when the append was rejected
    (0 for an entity without events). Reload the entity and retry the command.
    """

    def __init__(self, stream_id: "StreamId", expected: object, actual: int | None) -> None:
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual
        actual_text = "unknown" if actual is None else str(actual)
        super().__init__(
            f"Concurrency conflict on {stream_id}: expected version {expected}, but it is at version "
            f"{actual_text}. Nothing was stored; reload the entity and retry the command."
        )


class UncheckableQueryError(InvalidArgumentError):
    """A DCB append condition's query has an item the server cannot check (one without tags); nothing was sent.

    Such a query can be read, but not used as a condition: tag the events a decision depends on.
    """


class AppendConditionError(EventStoreError):
    """A DCB append's condition failed: an event its query matches (or, as the server checks it, one sharing a
    checked tag) was stored after ``after``; nothing of the append was stored.

    ``after`` is the condition's position, ``position`` the position of the first such event (None when the
    server's answer did not let it be found). Read the query again and decide again (a decision model does).
    """

    def __init__(self, after: int, position: int | None, tags: list[str]) -> None:
        self.after = after
        self.position = position
        self.tags = tags
        where = "at an unknown position" if position is None else f"at position {position}"
        super().__init__(
            f"Append condition failed: an event tagged with one of {tags} was stored {where}, after position "
            f"{after} that the decision read up to. Nothing was stored; read the query again and decide again."
        )


class InvalidStreamIdError(EventStoreError, ValueError):
    """A category or entity id cannot be used to name an entity's stream."""


class InvalidEventError(EventStoreError, ValueError):
    """An event cannot be stored as given; nothing was sent to the server."""


class EventTooLargeError(InvalidEventError):
    """A commit is larger than the server accepts in one message; nothing was stored."""


class UnknownEventTypeError(EventStoreError, LookupError):
    """A stored event's type name (or schema version) has no registered model."""


class EventDecodeError(EventStoreError):
    """A stored payload could not be turned into its registered model."""


class HistoryGapError(EventDecodeError):
    """An entity's stored history is not whole: a commit is missing (deleted, purged, lost in a restore), or a
    commit claims a place in it that the others deny (a forged version or back pointer). Nothing was returned.

    Raised by every load (``read``, ``Repository.get``, the snapshot and the tail after it) after the read was
    retried through the stream's leader, and by ``state``/``version``/``append`` when the entity's last commit
    contradicts itself. ``stream_id`` is the entity, ``position`` the stream position of the commit where the
    break was found, ``version`` the entity's version that was due there (None when unknown), ``problem`` what
    was found there. The stream must be
    repaired (restore the missing commits from a backup) before the entity can be loaded or appended to.
    """

    def __init__(self, stream_id: "StreamId", position: int | None, version: int | None, problem: str) -> None:
        self.stream_id = stream_id
        self.position = position
        self.version = version
        self.problem = problem
        super().__init__(
            f"Broken history at position {position if position is not None else '?'} on {stream_id}: "
            f"{problem}. Nothing was loaded and nothing will be appended to it: a load never returns a history "
            "with a hole. Commits were deleted, purged or lost in a restore, or written by another program; "
            "restore the stream from a backup (or re-publish the missing commits), then retry."
        )


class ServerUnavailableError(EventStoreError, ConnectionError):
    """The NATS server could not be reached, or did not answer in time."""


class AuthenticationError(ServerUnavailableError):
    """The server rejected the client's credentials, or the TLS handshake failed; raised at the first failure.

    Unlike other connection failures this is not retried: the same settings
    fail the same way. The message says what to fix (the credential settings,
    ``tls_ca_file``, or a client certificate).
    """


class StorageError(ServerUnavailableError):
    """The server is up but cannot store appends: JetStream's storage limit is reached, or its disk is full or
    read-only (a write failed). Every event it acknowledged stays stored.

    Retrying helps only once the server's storage is fixed; the message says what the operator must do (for a
    failed write, nats-server stores nothing more on the stream until it is restarted). Whether the failed
    append was stored is said in the message: certain only when no earlier send of it went unanswered.
    """


class EventStoreClosedError(EventStoreError):
    """The event store was closed: the call ends at once, whether it was waiting for the server or made later.

    Not a :class:`ServerUnavailableError`: waiting cannot bring a closed store
    back, so the outage policy (retries, ``outage_limit_s``) never applies to
    it. Connect a new :class:`~eventstore.EventStore` to go on.
    """


def store_closed(what: str) -> EventStoreClosedError:
    """The :class:`EventStoreClosedError` for the operation ``what`` ("Reading Account/42")."""
    return EventStoreClosedError(
        f"{what}: the event store was closed, which ends every call in flight and refuses new ones. "
        "Connect a new EventStore, or close it only after its work is done."
    )


class StreamConfigError(EventStoreError):
    """The JetStream stream exists with settings that are unsafe or incompatible for an event store."""


def what_was_stored(resent: bool) -> str:
    """What a failed append says of its sends: an unanswered earlier send may have been stored."""
    if resent:
        return ("An earlier send went unanswered and may have been stored: retry with the same idempotency key to "
                "find out safely.")
    return "Nothing was stored by this call."


def server_unavailable(what: str, timeout_s: float, exc: BaseException) -> ServerUnavailableError:
    """The :class:`ServerUnavailableError` for ``exc``, a lost or silent server's error during ``what``.

    ``what`` names the operation and its entity ("Reading Account/42"); the
    message says what happened in those terms (never an internal subject) and
    what to do. Raise it ``from exc``.
    """
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        why = (
            f"the NATS server did not answer within {timeout_s}s. Check that it is running and reachable, "
            "or raise request_timeout_s"
        )
    elif isinstance(exc, (NoRespondersError, ServiceUnavailableError)):
        why = (
            "JetStream did not answer (no responders). Check that the server runs with JetStream enabled (-js) "
            "and that the stream's servers are up"
        )
    elif isinstance(exc, ConnectionClosedError):
        why = ("the connection to NATS is closed for good (an outage outlasted outage_limit_s, or its owner closed "
               "it). Connect a new EventStore")
    else:
        why = f"the NATS server cannot be reached ({exc or type(exc).__name__}). Check that it is running and reachable"
    return ServerUnavailableError(f"{what}: {why}.")


def not_now_answer(what: str, description: object, err_code: object) -> ServerUnavailableError:
    """The :class:`ServerUnavailableError` for JetStream's "not now" answer (an election, servers offline: the
    codes of :data:`eventstore.jetstream.TRANSIENT_API_ERRORS`) to ``what``, quoting the server."""
    return ServerUnavailableError(
        f"{what}: JetStream answered {description!r} (err_code {err_code}): it is electing a leader, or too few of "
        "its servers are up. Retry once the cluster has a leader (check that its servers are running)."
    )


@contextlib.contextmanager
def map_nats_error(what: str, timeout_s: float, *, closed: Callable[[], bool] | None = None) -> Iterator[None]:
    """Raise :func:`server_unavailable`'s error for a lost or silent server's errors inside the block.

    The one boundary between nats-py's connection errors (timeouts, a closed or
    reconnecting connection, no responders) and :class:`ServerUnavailableError`;
    JetStream's "not now" answers (an election: :func:`not_now_answer`) are
    that too. Its other answers (:class:`nats.js.errors.APIError`, e.g. "stream
    not found") are not about the server being unavailable and pass through, as
    do this package's own errors. A closed connection is
    :class:`EventStoreClosedError` when ``closed()`` says the store closed it,
    else (an outage outlasted ``outage_limit_s``) :class:`ServerUnavailableError`.
    """
    try:
        yield
    except EventStoreError:
        raise  # already says what happened
    except APIError as exc:
        from .jetstream.api import TRANSIENT_API_ERRORS  # not at the top: the jetstream package imports this module

        if exc.err_code in TRANSIENT_API_ERRORS:
            raise not_now_answer(what, exc.description, exc.err_code) from exc
        if isinstance(exc, ServiceUnavailableError):
            raise server_unavailable(what, timeout_s, exc) from exc
        raise
    except ConnectionClosedError as exc:
        if closed is not None and closed():
            raise store_closed(what) from exc
        raise server_unavailable(what, timeout_s, exc) from exc
    except (NatsError, asyncio.TimeoutError) as exc:
        raise server_unavailable(what, timeout_s, exc) from exc

"""Errors raised by the event store.

Every error the package raises derives from :class:`EventStoreError`, and says
what was wrong and what to do about it::

    EventStoreError
    ├── InvalidArgumentError      a call's argument has the wrong type or value (also TypeError, ValueError)
    ├── ConcurrencyError          an append's expected version did not hold
    ├── InvalidStreamIdError      a category or entity id cannot name a stream
    ├── InvalidEventError         an event cannot be stored (bad type name, empty append, ...)
    │   └── EventTooLargeError    a commit exceeds the server's max payload
    ├── UnknownEventTypeError     a stored event's type is not registered
    ├── EventDecodeError          a stored payload does not validate against its model
    ├── ServerUnavailableError    the server cannot be reached or did not answer in time
    │   └── AuthenticationError   the server rejected the credentials, or TLS failed: retrying cannot help
    └── StreamConfigError         the stream exists with settings unfit for an event store

Backend errors (nats-py exceptions, JetStream ``err_code`` values) are turned
into these at one boundary, :func:`eventstore.append`'s reply handling and
:func:`map_nats_error`, always with ``raise ... from exc``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .streams import StreamId

__all__ = [
    "AuthenticationError",
    "ConcurrencyError",
    "EventDecodeError",
    "EventStoreError",
    "EventTooLargeError",
    "InvalidArgumentError",
    "InvalidEventError",
    "InvalidStreamIdError",
    "ServerUnavailableError",
    "StreamConfigError",
    "UnknownEventTypeError",
]


class EventStoreError(Exception):
    """Base of every error raised by :mod:`eventstore`."""


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


class ServerUnavailableError(EventStoreError, ConnectionError):
    """The NATS server could not be reached, or did not answer in time."""


class AuthenticationError(ServerUnavailableError):
    """The server rejected the client's credentials, or the TLS handshake failed; raised at the first failure.

    Unlike other connection failures this is not retried: the same settings
    fail the same way. The message says what to fix (the credential settings,
    ``tls_ca_file``, or a client certificate).
    """


class StreamConfigError(EventStoreError):
    """The JetStream stream exists with settings that are unsafe or incompatible for an event store."""

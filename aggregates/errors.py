"""Errors raised by aggregates and repositories.

Every error this package raises derives from :class:`AggregateError` and names
what to fix: the aggregate class and id, and for stored events their position
and type::

    AggregateError
    ├── AggregateDefinitionError   an aggregate or event class is declared wrongly (raised at import)
    ├── AggregateNotFoundError     no events for that id, or fewer than the version asked for
    ├── AggregateExistsError       a creating command met an aggregate that has events already
    ├── InvalidAggregateIdError    the id cannot name a stream  (also eventstore.InvalidStreamIdError)
    ├── MissingHandlerError        the aggregate has no @applies handler for an event's type
    ├── UnregisteredEventError     a stored event's type has no registered model  (also eventstore.UnknownEventTypeError)
    ├── InvalidStoredEventError    a stored payload does not upcast or validate  (also eventstore.EventDecodeError)
    ├── DomainError                base for your own invariant violations: a command refused
    │   └── CommandRejectedError   a command sent over NATS was refused by the aggregate (the service's DomainError)
    └── CommandError               a command sent over NATS (:class:`CommandClient`) did not succeed
        ├── InvalidCommandError    malformed, too large to send, or named no aggregate the service can serve
        ├── CommandConflictError   it kept conflicting with concurrent writers until the service gave up
        ├── CommandFailedError     the service's handler raised an unexpected error (a bug: see its log)
        └── CommandUnavailableError  no service answered in time: retry with the same command id

A conflicting save raises the event store's own
:class:`~eventstore.ConcurrencyError`, unchanged: it is the one error callers
retry on, and catching it should not depend on which layer raised it.
"""

from __future__ import annotations

from eventstore import EventDecodeError, InvalidStreamIdError, UnknownEventTypeError

__all__ = [
    "AggregateDefinitionError",
    "AggregateError",
    "AggregateExistsError",
    "AggregateNotFoundError",
    "CommandConflictError",
    "CommandError",
    "CommandFailedError",
    "CommandRejectedError",
    "CommandUnavailableError",
    "DomainError",
    "InvalidCommandError",
    "InvalidAggregateIdError",
    "InvalidStoredEventError",
    "MissingHandlerError",
    "UnregisteredEventError",
]


class AggregateError(Exception):
    """Base of every error raised by :mod:`aggregates`."""


class AggregateDefinitionError(AggregateError, TypeError):
    """An aggregate, event or upcaster is declared wrongly; raised when the class or function is defined."""


class AggregateNotFoundError(AggregateError, LookupError):
    """The aggregate has no events (or fewer than the version asked for); nothing was written."""

    def __init__(self, aggregate: str, aggregate_id: str, version: int | None = None, actual: int = 0) -> None:
        self.aggregate = aggregate
        self.aggregate_id = aggregate_id
        self.version = version
        if version is None:
            text = f"{aggregate} {aggregate_id!r} does not exist: it has no events. Create it with a command first."
        else:
            text = (
                f"{aggregate} {aggregate_id!r} has no version {version}: it has {actual} events. "
                "Ask for a version between 1 and its current version."
            )
        super().__init__(text)


class AggregateExistsError(AggregateError):
    """A creating command (``create=True``) met an aggregate that has events already; nothing was written.

    A creation that was already applied with the same ``command_id`` is not
    this error: it is answered as a duplicate.
    """

    def __init__(self, aggregate: str, aggregate_id: str, version: int | None = None) -> None:
        self.aggregate = aggregate
        self.aggregate_id = aggregate_id
        self.version = version
        at = f" (version {version})" if version is not None else ""
        super().__init__(
            f"{aggregate} {aggregate_id!r} exists already{at}: a creating command runs only on a new aggregate. "
            "Send a command for an existing one, or pass exist_ok=True to create it or run on it as it is."
        )


class InvalidAggregateIdError(AggregateError, InvalidStreamIdError):
    """The id cannot name an aggregate's stream (empty, too long, control characters); nothing was written."""


class _EventFacts(AggregateError):
    """Carries which aggregate, event type and (stored) position an error is about."""

    def __init__(self, aggregate: str, aggregate_id: str, event_type: str, position: int | None, message: str) -> None:
        self.aggregate = aggregate
        self.aggregate_id = aggregate_id
        self.event_type = event_type
        self.position = position
        super().__init__(message)


class MissingHandlerError(_EventFacts, LookupError):
    """The aggregate has no ``@applies`` handler for an event's type; nothing was recorded or written.

    ``position`` is set when the event was read from the store, None when it was being recorded.
    """

    def __init__(self, aggregate: str, aggregate_id: str, event_type: str, position: int | None = None) -> None:
        where = f" stored at position {position}" if position is not None else ""
        super().__init__(
            aggregate, aggregate_id, event_type, position,
            f"{aggregate} {aggregate_id!r} has no handler for event type {event_type!r}{where}. "
            f"Add a method decorated with @applies({event_type}) to {aggregate}.",
        )


class UnregisteredEventError(_EventFacts, UnknownEventTypeError):
    """A stored event's type (or schema version) has no registered model, so the aggregate cannot be loaded."""

    def __init__(self, aggregate: str, aggregate_id: str, event_type: str, position: int, reason: str) -> None:
        super().__init__(
            aggregate, aggregate_id, event_type, position,
            f"Cannot load {aggregate} {aggregate_id!r}: the event at position {position} has type "
            f"{event_type!r}, which this program cannot read: {reason}",
        )


class InvalidStoredEventError(_EventFacts, EventDecodeError):
    """A stored event's payload failed its upcasters or validation, so the aggregate cannot be loaded."""

    def __init__(self, aggregate: str, aggregate_id: str, event_type: str, position: int, reason: str) -> None:
        super().__init__(
            aggregate, aggregate_id, event_type, position,
            f"Cannot load {aggregate} {aggregate_id!r}: the {event_type!r} event at position {position} "
            f"cannot be read: {reason}",
        )


class DomainError(AggregateError):
    """Base for your invariant violations: raise it (or a subclass) from a command to refuse it.

    A refused command records nothing and :meth:`Repository.execute` never
    retries it.
    """


class CommandRejectedError(DomainError):
    """The aggregate refused a command sent over NATS: the service's handler raised :class:`DomainError`.

    Nothing was stored. ``error_type`` is the name of the class the handler raised.
    """

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class CommandError(AggregateError):
    """Base of the errors a :class:`~aggregates.CommandClient` raises when a command did not succeed (besides
    :class:`CommandRejectedError` and :class:`AggregateNotFoundError`, which say the same as in-process)."""


class InvalidCommandError(CommandError, ValueError):
    """The command was refused as sent: the client found it larger than the server takes (then nothing was sent),
    or the service could not take it (not JSON, not valid for its model, no usable command id, a bad aggregate
    id). Nothing ran; fix the request."""


class CommandConflictError(CommandError):
    """The command conflicted with concurrent writers on every attempt the service's retry policy allows.
    Nothing was stored; sending it again (with the same command id) is safe."""


class CommandFailedError(CommandError):
    """The service's handler raised an unexpected error (not a :class:`DomainError`): a bug on the service's
    side, logged there with its traceback. Nothing was stored (a stored command is always answered as a success,
    with :attr:`CommandReply.value_error <aggregates.CommandReply.value_error>` when its value could not be sent)."""


class CommandUnavailableError(CommandError, ConnectionError):
    """No service answered: none serves the command's subject, or no answer came within the timeout.

    After a timeout the command may or may not have run; sending it again with
    the same command id is safe: it runs at most once.
    """

"""Errors of reactors, and the signal a handler raises for a poison event.

Every error the reactor runner raises derives from :class:`ReactorError` (itself
a :class:`~projections.errors.ProjectionError`) and says what was wrong and what
to do about it::

    ProjectionError
    └── ReactorError
        ├── ReactorConfigError     a Reactor definition or worker option is invalid (also a ValueError)
        ├── ReactorConsumerError   the server refused the reactor's durable consumer, or it vanished
        └── DeadLetterStreamError  the dead-letter stream could not be created, checked or written

Backend errors (nats-py exceptions, JetStream ``err_code`` values) become these
in one place each, always with ``raise ... from exc``. A server that cannot be
reached raises :class:`eventstore.ServerUnavailableError`, as everywhere else.

:class:`PoisonEvent` is not an error of the runner: handlers raise it to say
"retrying this event cannot help".
"""

from __future__ import annotations

from ..errors import ProjectionError

__all__ = ["DeadLetterStreamError", "PoisonEvent", "ReactorConfigError", "ReactorConsumerError", "ReactorError"]


class ReactorError(ProjectionError):
    """Base of every error raised by the reactor runner (a :class:`ProjectionError`, the package's root)."""


class ReactorConfigError(ReactorError, ValueError):
    """A :class:`~projections.reactors.Reactor` definition or a worker option is invalid; the message names the field."""


class ReactorConsumerError(ReactorError):
    """The server refused to create, update or serve the reactor's durable consumer.

    Raised, for example, when a consumer of that name exists but is not a
    reactor's (a push consumer, or one without explicit acks), or when the
    consumer is deleted while workers run.
    """


class DeadLetterStreamError(ReactorError):
    """The dead-letter stream could not be created, checked or written.

    A worker that cannot dead-letter an event does not drop it: it leaves the
    event unacknowledged so the attempt is repeated (on the last delivery, the
    max-deliveries advisory gives it one more chance).
    """


class PoisonEvent(Exception):
    """Raise it from a handler when retrying the event cannot help (e.g. it refers to something that never existed).

    The worker then stops delivering the event (``+TERM``) and stores it in the
    dead-letter stream with ``str(exc)`` as the reason, whatever its delivery
    count. Every other exception is retried until ``max_deliver``.
    """

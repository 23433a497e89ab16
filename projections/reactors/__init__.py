"""Reactors: event handlers with side effects, run by workers on a durable consumer (see :mod:`.worker`).

:mod:`.worker` holds the definition (:class:`Reactor`) and the worker,
:mod:`.dead_letters` the dead-letter stream, :mod:`.retry` running a reactor again on its dead letters, :mod:`.status` what ``jetsourcing status`` shows of them,
:mod:`.errors` the reactors' errors.
"""

from .dead_letters import DeadLetterReason, ReactorDeadLetter, drop_reactor_dead_letters, read_reactor_dead_letters
from .status import ReactorStatus, format_reactor_status, read_reactor_status
from .retry import RetryResult, retry_reactor_dead_letters
from .errors import DeadLetterStreamError, PoisonEvent, ReactorConfigError, ReactorConsumerError, ReactorError
from .worker import Reactor, ReactorHandler, ReactorStart, ReactorStats, ReactorWorker, run_reactor

__all__ = [
    "DeadLetterReason",
    "DeadLetterStreamError",
    "PoisonEvent",
    "Reactor",
    "ReactorConfigError",
    "ReactorConsumerError",
    "ReactorDeadLetter",
    "ReactorError",
    "ReactorHandler",
    "ReactorStart",
    "ReactorStats",
    "ReactorStatus",
    "ReactorWorker",
    "RetryResult",
    "drop_reactor_dead_letters",
    "format_reactor_status",
    "read_reactor_dead_letters",
    "read_reactor_status",
    "retry_reactor_dead_letters",
    "run_reactor",
]

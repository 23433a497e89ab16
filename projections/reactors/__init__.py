"""Reactors: event handlers with side effects, run by workers on a durable consumer (see :mod:`.worker`).

:mod:`.worker` holds the definition (:class:`Reactor`) and the worker,
:mod:`.dead_letters` the dead-letter stream, :mod:`.errors` the reactors' errors.
"""

from .dead_letters import DeadLetterReason, ReactorDeadLetter, read_reactor_dead_letters
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
    "ReactorWorker",
    "read_reactor_dead_letters",
    "run_reactor",
]

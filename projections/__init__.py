__all__: list[str] = []

# reactors
# (exports of reactors.py are added here by its author; keep this section intact)
from .reactor_dlq import DeadLetterReason, ReactorDeadLetter, read_reactor_dead_letters
from .reactor_errors import (
    DeadLetterStreamError,
    PoisonEvent,
    ReactorConfigError,
    ReactorConsumerError,
    ReactorError,
)
from .reactors import Reactor, ReactorHandler, ReactorStats, ReactorWorker, Start, run_reactor

__all__ += [
    "DeadLetterReason",
    "DeadLetterStreamError",
    "PoisonEvent",
    "Reactor",
    "ReactorConfigError",
    "ReactorConsumerError",
    "ReactorDeadLetter",
    "ReactorError",
    "ReactorHandler",
    "ReactorStats",
    "ReactorWorker",
    "Start",
    "read_reactor_dead_letters",
    "run_reactor",
]
# end reactors

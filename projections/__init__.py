# reactors (names for __all__: DeadLetter, DeadLetterError, DeadLetterReason, Handler, PoisonEvent, Reactor,
# ReactorConfigError, ReactorConsumerError, ReactorError, ReactorStats, ReactorWorker, Start, read_dead_letters,
# run_reactor)
from .reactor_dlq import DeadLetter as DeadLetter
from .reactor_dlq import DeadLetterReason as DeadLetterReason
from .reactor_dlq import read_dead_letters as read_dead_letters
from .reactor_errors import DeadLetterError as DeadLetterError
from .reactor_errors import PoisonEvent as PoisonEvent
from .reactor_errors import ReactorConfigError as ReactorConfigError
from .reactor_errors import ReactorConsumerError as ReactorConsumerError
from .reactor_errors import ReactorError as ReactorError
from .reactors import Handler as Handler
from .reactors import Reactor as Reactor
from .reactors import ReactorStats as ReactorStats
from .reactors import ReactorWorker as ReactorWorker
from .reactors import Start as Start
from .reactors import run_reactor as run_reactor
# end reactors

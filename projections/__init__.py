"""jetsourcing projections: read models kept up to date from the event store, exactly once.

If you are here to read the code, start with ``projection.py`` (defining a
projection: handlers and declared tables), then ``tables.py`` and
``transaction.py`` (the backend-neutral API handlers write through, and the
in-memory store Spark folds into), ``store.py`` (what a read-model backend
must guarantee) ``sql.py`` (the SQL backends' generations, views and checkpoint
compare-and-set) with its dialects ``sqlite.py`` (embedded) and ``postgres.py``
(with ``postgres_deadline.py``, the client's deadline on a silent server),
``backends.py`` (which one the settings select), ``source.py`` (reading whole commits, skipping
unhandled ones undecoded), ``applier.py`` (batches, exactly once, error
policies), ``outages.py`` (store calls through a database outage),
``daemon.py`` (runners, leases from ``lease.py``; signals in ``shutdown.py``),
``rebuild.py`` (shadow replay and atomic switch), ``status.py``, ``cli.py``,
``progress.py``, ``settings.py``, ``connection.py`` and ``errors.py``.
``reactors/`` (side effects, not read models) is a separate family; see
the section marked ``# reactors`` below.
"""

from .applier import Counters
from .daemon import Daemon, Outcome, run_daemon
from .errors import (
    CheckpointConflictError,
    HandlerError,
    LeaseError,
    ProjectionDefinitionError,
    ProjectionError,
    ProjectionLoadError,
    ProjectionStoppedError,
    ReadModelMismatchError,
    ReadModelNotFoundError,
    RebuildError,
    RowError,
)
from eventstore import import_object  # where it was exported before it moved to eventstore

from .loading import load_projection
from .projection import ErrorPolicy, Projection, handles
from .rebuild import RebuildResult, rebuild
from .settings import ProjectionSettings
from .backends import open_store
from .sql import SqlTransaction
from .sqlite import SqliteStore
from .status import ProjectionStatus, format_status, read_status, read_statuses
from .store import DeadLetter, ReadModelStore
from .tables import Table
from .transaction import MemoryStore, Transaction, fold
from .progress import ProgressReporter, RichProgress, progress_for
from .reactors import (
    DeadLetterReason,
    DeadLetterStreamError,
    PoisonEvent,
    Reactor,
    ReactorConfigError,
    ReactorConsumerError,
    ReactorDeadLetter,
    ReactorError,
    ReactorHandler,
    ReactorStart,
    ReactorStats,
    ReactorStatus,
    ReactorWorker,
    RetryResult,
    drop_reactor_dead_letters,
    format_reactor_status,
    read_reactor_dead_letters,
    read_reactor_status,
    retry_reactor_dead_letters,
    run_reactor,
)

__all__ = [
    "CheckpointConflictError",
    "Counters",
    "Daemon",
    "DeadLetter",
    "DeadLetterReason",
    "DeadLetterStreamError",
    "ErrorPolicy",
    "HandlerError",
    "LeaseError",
    "MemoryStore",
    "Outcome",
    "PoisonEvent",
    "PostgresStore",
    "ProgressReporter",
    "Projection",
    "ProjectionDefinitionError",
    "ProjectionError",
    "ProjectionLoadError",
    "ProjectionSettings",
    "ProjectionStatus",
    "ProjectionStoppedError",
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
    "ReadModelMismatchError",
    "ReadModelNotFoundError",
    "ReadModelStore",
    "RebuildError",
    "RebuildResult",
    "RetryResult",
    "RichProgress",
    "RowError",
    "SqlTransaction",
    "SqliteStore",
    "Table",
    "Transaction",
    "drop_reactor_dead_letters",
    "fold",
    "format_reactor_status",
    "format_status",
    "handles",
    "import_object",
    "load_projection",
    "open_store",
    "progress_for",
    "read_reactor_dead_letters",
    "read_reactor_status",
    "read_status",
    "read_statuses",
    "rebuild",
    "retry_reactor_dead_letters",
    "run_daemon",
    "run_reactor",
]


def __getattr__(name: str) -> object:
    # PostgresStore needs psycopg (the [postgres] extra): imported on first use only.
    if name == "PostgresStore":
        from .postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Errors raised by projections.

Every error the package raises derives from :class:`ProjectionError` and says
what went wrong and what to do about it::

    ProjectionError
    ├── ProjectionDefinitionError   a projection class or table declaration is invalid
    ├── ProjectionLoadError         a ``module:Class`` import path could not be loaded
    ├── RowError                    a handler wrote a row that does not fit its declared table
    ├── HandlerError                a handler raised: position, event type, stream id, traceback
    ├── ProjectionStoppedError      a projection was stopped by its error policy (wraps a HandlerError)
    ├── CheckpointConflictError     the read model's checkpoint moved under this writer
    ├── ReadModelMismatchError      the stored read model does not match the projection's definition
    ├── ReadModelNotFoundError      a read-only command found no read models where the settings point
    ├── LeaseError                  the lease service (JetStream KV) refused or lost a lease
    └── RebuildError                a rebuild failed or was interrupted; the old model is unchanged

Errors of a read-model backend (``sqlite3`` exceptions) that are not caused by
an event are not wrapped: they are operational failures (disk full, database
locked for longer than the busy timeout) and are reported as they are.
"""

from __future__ import annotations

__all__ = [
    "CheckpointConflictError",
    "HandlerError",
    "LeaseError",
    "ProjectionDefinitionError",
    "ProjectionError",
    "ProjectionLoadError",
    "ProjectionStoppedError",
    "ReadModelMismatchError",
    "ReadModelNotFoundError",
    "RebuildError",
    "RowError",
]


class ProjectionError(Exception):
    """Base of every error raised by :mod:`projections`."""


class ProjectionDefinitionError(ProjectionError, TypeError):
    """A projection class or a table declaration is invalid; raised when the class is defined or bound."""


class ProjectionLoadError(ProjectionError, ImportError):
    """A projection given as ``module:Class`` could not be imported or is not a projection."""


class RowError(ProjectionError, ValueError):
    """A handler read or wrote a row that does not fit its table (unknown table or column, wrong type, bad key)."""


class HandlerError(ProjectionError):
    """A handler raised while applying an event. Names the event exactly; ``__cause__`` is the original error.

    ``traceback`` is the formatted traceback of the original error, so the
    report survives being stored and shown by another process.
    """

    def __init__(
        self,
        projection: str,
        *,
        position: int,
        index: int,
        event_type: str,
        stream_id: str,
        event_id: str,
        error: str,
        traceback: str,
    ) -> None:
        self.projection = projection
        self.position = position
        self.index = index
        self.event_type = event_type
        self.stream_id = stream_id
        self.event_id = event_id
        self.error = error
        self.traceback = traceback
        super().__init__(
            f"Projection {projection!r} failed on event {event_type!r} of {stream_id} at position {position} "
            f"(index {index}, event id {event_id}): {error}"
        )


class ProjectionStoppedError(ProjectionError):
    """A projection stopped because a handler failed and its error policy is ``stop``.

    The read model holds every commit before :attr:`failure`'s position; the
    checkpoint says so. Fix the handler (then rebuild if the fix changes past
    results, bumping ``version``), or switch the projection to the
    ``dead_letter`` policy, and start the daemon again.
    """

    def __init__(self, failure: HandlerError) -> None:
        self.failure = failure
        super().__init__(f"{failure} -- stopped; the checkpoint is {failure.position - 1}.")


class CheckpointConflictError(ProjectionError):
    """The stored checkpoint was not the one this writer expected; nothing of the batch was stored.

    Another writer took the projection over (its lease expired), or a rebuild
    switched readers to a new generation. The daemon reloads and resumes from
    the stored checkpoint.
    """


class ReadModelMismatchError(ProjectionError):
    """The stored read model was built by a different definition: version, tables or event stream differ.

    A higher declared ``version`` means "rebuild": run ``jetsourcing rebuild``
    (the daemon does it by itself unless ``auto_rebuild`` is off).
    """


class ReadModelNotFoundError(ProjectionError, LookupError):
    """There are no read models where the settings point (no SQLite file, no PostgreSQL schema, or no
    projection has run there yet), and the command only reads: it created nothing. Check the database
    setting (``--db``, ``JETSOURCING_DATABASE``, ``JETSOURCING_POSTGRES_SCHEMA``), or run a projection first."""


class LeaseError(ProjectionError):
    """The lease service refused or lost a lease, or a lease is held by someone else."""


class RebuildError(ProjectionError):
    """A rebuild failed or was interrupted. Readers still see the old model, which the daemon keeps updating."""

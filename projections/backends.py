"""Which read-model store the settings select: a SQLite file, or PostgreSQL for a ``postgresql://`` URL."""

from __future__ import annotations

from .settings import ProjectionSettings
from .store import ReadModelStore

__all__ = ["open_store"]


def open_store(settings: ProjectionSettings, *, create: bool = True) -> ReadModelStore:
    """A connection to the read models ``settings.database`` names, configured from ``settings``. Blocking: from
    async code, ``await asyncio.to_thread(open_store, settings)``.

    With ``create`` (the default, for the daemon and rebuilds) the SQLite file, the PostgreSQL schema and the
    bookkeeping tables are created if missing. Readers pass ``create=False``: nothing is created, and where
    there are no read models yet :class:`~projections.errors.ReadModelNotFoundError` says so.
    """
    url = settings.postgres_url
    if url is not None:
        from .postgres import PostgresStore

        return PostgresStore(url, schema=settings.postgres_schema, timeout_s=settings.postgres_timeout_s,
                             cache_rows=settings.row_cache_size, create=create)
    from .sqlite import SqliteStore

    return SqliteStore(settings.database, synchronous=settings.sqlite_synchronous,
                       busy_timeout_s=settings.sqlite_busy_timeout_s, cache_rows=settings.row_cache_size,
                       create=create)

"""Which read-model store the settings select: a SQLite file, or PostgreSQL for a ``postgresql://`` URL."""

from __future__ import annotations

from .settings import ProjectionSettings
from .store import ReadModelStore

__all__ = ["open_store", "store_exists"]


def open_store(settings: ProjectionSettings) -> ReadModelStore:
    """A connection to the read models ``settings.database`` names (created if missing), configured from
    ``settings``. Blocking: from async code, ``await asyncio.to_thread(open_store, settings)``."""
    url = settings.postgres_url
    if url is not None:
        from .postgres import PostgresStore

        return PostgresStore(url, schema=settings.postgres_schema, timeout_s=settings.postgres_timeout_s,
                             cache_rows=settings.row_cache_size)
    from .sqlite import SqliteStore

    return SqliteStore(settings.database, synchronous=settings.sqlite_synchronous,
                       busy_timeout_s=settings.sqlite_busy_timeout_s, cache_rows=settings.row_cache_size)


def store_exists(settings: ProjectionSettings) -> bool:
    """False when ``settings.database`` is a SQLite file that does not exist (reading it would create it)."""
    return isinstance(settings.database, str) or settings.database.exists()

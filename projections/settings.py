"""Settings of the projection daemon, rebuilds and status: read once, at the edge.

Explicit arguments beat environment variables (``JETSOURCING_<FIELD>``, e.g.
``JETSOURCING_DATABASE``), which beat defaults. The connection and stream
come from the nested :class:`~eventstore.EventStoreSettings` (``NATS_URL``,
``JETSOURCING_STREAM``, ...)::

    ProjectionSettings()                                             # defaults + environment
    ProjectionSettings(database="views.sqlite3", batch_size=500)      # explicit
    settings.model_copy(update={"lease_ttl_s": 2.0})                 # a changed copy
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventstore import EventStoreSettings

from .projection import ErrorPolicy

__all__ = ["ProjectionSettings"]

SCHEMA_PATTERN = r"^[a-z_][a-z0-9_]{0,62}$"
"""A PostgreSQL schema jetsourcing may use: a plain lower-case identifier, never quoted differently (and not
one of :func:`reserved_schema`'s)."""


def reserved_schema(schema: str) -> str | None:
    """Why PostgreSQL keeps ``schema`` for itself (``pg_*``, ``information_schema``), or None when it does not."""
    if schema.startswith("pg_"):
        return "PostgreSQL reserves schema names starting with 'pg_' for its own catalogs"
    if schema == "information_schema":
        return "information_schema is PostgreSQL's catalog of the SQL standard"
    return None

_URL = re.compile(r"^postgres(ql)?://", re.IGNORECASE)
_PASSWORD = re.compile(r"^([a-z]+://[^:/@]*):[^@]*@", re.IGNORECASE)


class ProjectionSettings(BaseSettings):
    """Where read models live and how the daemon runs them (immutable)."""

    model_config = SettingsConfigDict(env_prefix="JETSOURCING_", frozen=True, extra="forbid", env_ignore_empty=True)

    eventstore: EventStoreSettings = Field(
        default_factory=EventStoreSettings, description="Server URL and stream (NATS_URL, JETSOURCING_STREAM, ...)."
    )
    database: Path | str = Field(
        default=Path("jetsourcing.sqlite3"),
        description="Where the read models live: a SQLite file (the default, embedded), or a PostgreSQL URL "
        "(postgresql://user:password@host:5432/db).",
    )
    batch_size: int = Field(default=1000, ge=1, le=100_000, description="Events per pull request while following.")
    rebuild_batch_size: int = Field(default=10_000, ge=1, le=100_000, description="Events per pull request in rebuilds.")
    error_policy: ErrorPolicy | None = Field(
        default=None, description="Overrides every projection's own error_policy: 'stop' or 'dead_letter'."
    )
    auto_rebuild: bool = Field(
        default=True, description="Rebuild a projection whose declared version is newer than its read model's."
    )
    lease_bucket: str = Field(
        default="jetsourcing_leases", pattern=r"^[A-Za-z0-9_-]+$", description="JetStream KV bucket of the leases."
    )
    lease_ttl_s: float = Field(
        default=10.0, ge=1.0, description="A dead daemon's projections are taken over within this many seconds."
    )
    heartbeat_s: float = Field(
        default=1.0, gt=0, description="Consumer idle heartbeat: how fast a lost server connection is noticed."
    )
    status_interval_s: float = Field(default=2.0, gt=0, description="How often an idle daemon records a heartbeat.")
    shutdown_timeout_s: float = Field(
        default=8.0, gt=0,
        description="How long a stop (SIGINT/SIGTERM) may take to finish batches and release leases before the "
        "daemon cancels its work; a second signal cancels at once.",
    )
    stale_after_s: float = Field(
        default=15.0, gt=0, description="status reports a 'running' projection without heartbeat for this long as stale."
    )
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        default="NORMAL", description="NORMAL survives process crashes; FULL also power loss (slower)."
    )
    sqlite_busy_timeout_s: float = Field(default=30.0, gt=0, description="How long a write waits for another writer.")
    postgres_schema: str = Field(
        default="public", pattern=SCHEMA_PATTERN,
        description="The PostgreSQL schema holding the read models (created if missing).",
    )
    postgres_timeout_s: float = Field(
        default=30.0, gt=0, description="PostgreSQL: how long connecting, one statement or one lock wait may take."
    )
    row_cache_size: int = Field(default=100_000, ge=0, description="Committed rows a writer keeps in memory.")

    @field_validator("database", mode="before")
    @classmethod
    def _database(cls, value: object) -> object:
        """A PostgreSQL URL stays a string; anything else names a SQLite file."""
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("give a SQLite file or a postgresql:// URL")
            if not _URL.match(value):
                if "://" in value:
                    raise ValueError(f"{value.split('://')[0]}:// is not a read-model database: use a SQLite file "
                                     "path or a postgresql:// URL")
                return Path(value)
        return value

    @field_validator("postgres_schema")
    @classmethod
    def _schema(cls, value: str) -> str:
        reason = reserved_schema(value)
        if reason is not None:
            raise ValueError(f"{value!r} is reserved ({reason}): choose another schema")
        return value

    @property
    def postgres_url(self) -> str | None:
        """The PostgreSQL URL when the read models live in PostgreSQL, else None."""
        return self.database if isinstance(self.database, str) else None

    @property
    def database_name(self) -> str:
        """The database, for messages: the file, or the URL without its password."""
        if isinstance(self.database, str):
            return _PASSWORD.sub(r"\1***@", self.database)
        return str(self.database)

"""Settings of a command service run from the command line (``jetsourcing serve``).

Explicit arguments beat environment variables (``JETSOURCING_COMMAND_<FIELD>``,
e.g. ``JETSOURCING_COMMAND_MAX_IN_FLIGHT``), which beat defaults. The
connection and stream come from the nested :class:`~eventstore.EventStoreSettings`
(``NATS_URL``, ``JETSOURCING_STREAM``, ...).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventstore import EventStoreSettings

from .routing import DEFAULT_PARTITIONS, MAX_PARTITIONS

__all__ = ["CommandServiceSettings"]


class CommandServiceSettings(BaseSettings):
    """How a :class:`~aggregates.CommandService` serves (immutable)."""

    model_config = SettingsConfigDict(env_prefix="JETSOURCING_COMMAND_", frozen=True, extra="forbid", env_ignore_empty=True)

    eventstore: EventStoreSettings = Field(
        default_factory=EventStoreSettings, description="Server URL and stream (NATS_URL, JETSOURCING_STREAM, ...)."
    )
    subject_prefix: str = Field(
        default="cmd", pattern=r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){0,7}$",
        description="Commands are served on <subject_prefix>.<Category>.<Command>.",
    )
    queue: str = Field(
        default="jetsourcing-commands", pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$",
        description="The queue group: processes in the same group share the commands.",
    )
    max_in_flight: int = Field(default=64, ge=1, le=100_000, description="Commands run at once by one process.")
    drain_timeout_s: float = Field(
        default=10.0, gt=0, le=3600,
        description="How long a stop (SIGTERM) lets the commands received finish before cancelling them.",
    )

    routing: bool = Field(
        default=True, description="Route each aggregate's commands to one worker (its partition's), keeping caches warm.",
    )
    partitions: int = Field(
        default=DEFAULT_PARTITIONS, ge=1, le=MAX_PARTITIONS,
        description="Partitions of the aggregate ids per category: the same for every service of the subject prefix.",
    )
    member_ttl_s: float = Field(
        default=3.0, ge=0.3, le=3600,
        description="A worker not heard from for this long is taken as gone: its partitions move to the others.",
    )

    def service_options(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~aggregates.CommandService` these settings give."""
        return {"subject_prefix": self.subject_prefix, "queue": self.queue, "max_in_flight": self.max_in_flight,
                "drain_timeout_s": self.drain_timeout_s, "routing": self.routing, "partitions": self.partitions,
                "member_ttl_s": self.member_ttl_s}

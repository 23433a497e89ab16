"""Settings of the event store: read once, at the edge.

Explicit arguments beat environment variables, which beat defaults::

    EventStoreSettings()                              # defaults + environment
    EventStoreSettings(stream="ORDERS")               # explicit
    settings.model_copy(update={"replicas": 3})       # a changed copy

Environment variables: ``NATS_URL`` (or ``JETSOURCING_NATS_URL``) and
``JETSOURCING_<FIELD>`` for every other field, e.g. ``JETSOURCING_STREAM``.

The fields that secure the connection (``user``, ``password``, ``token``,
``nkey_seed_file``, ``credentials_file``, ``tls_*``) come from
:class:`~eventstore.ConnectionSecurity`, with its checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import InvalidArgumentError
from .security import ConnectionSecurity, check_url_credentials, redact_url

__all__ = ["EventStoreSettings"]


class EventStoreSettings(BaseSettings, ConnectionSecurity):
    """How to reach (and authenticate to) the server and how the event store's stream is laid out (immutable)."""

    # An empty variable (`export NATS_URL=`, a blank line in a compose file) means "not set", as in a shell,
    # rather than a URL or stream name of no characters.
    model_config = SettingsConfigDict(
        env_prefix="JETSOURCING_", frozen=True, extra="forbid", hide_input_in_errors=True, env_ignore_empty=True
    )

    nats_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("nats_url", "NATS_URL", "JETSOURCING_NATS_URL"),
        description="Server or cluster URL(s), comma-separated; nats://user:password@host or nats://token@host "
        "carry credentials. None starts an embedded nats-server.",
    )
    stream: str = Field(default="EVENTS", pattern=r"^[A-Za-z0-9_-]+$", description="JetStream stream name.")
    subject_prefix: str = Field(
        default="events", pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$", description="Subjects are <prefix>.<Category>.<id>."
    )
    duplicate_window_s: float = Field(
        default=120.0,
        gt=0,
        le=7 * 86400.0,
        allow_inf_nan=False,
        description="How long the server remembers Nats-Msg-Id values.",
    )
    replicas: int = Field(default=1, ge=1, le=5, description="Stream replicas: 1 embedded, 3 on a cluster.")
    # No max age: JetStream expires old messages past max_age whatever the discard policy, so an
    # age limit would delete acknowledged events. Count and size limits refuse new writes instead.
    max_msgs: int | None = Field(default=None, gt=0, description="None: no limit; else appends beyond it are refused.")
    max_bytes: int | None = Field(default=None, gt=0, description="None: no limit; else appends beyond it are refused.")
    request_timeout_s: float = Field(
        default=5.0, ge=0.05, le=3600.0, allow_inf_nan=False, description="How long to wait for one server reply."
    )
    append_retries: int = Field(default=3, ge=0, le=20, description="Resends of a commit whose acknowledgement timed out.")
    ping_interval_s: float = Field(
        default=5.0,
        ge=0.05,
        le=3600.0,
        allow_inf_nan=False,
        description="How often each connection PINGs its server. A server that stays silent (a lost host, a partition: "
        "no reset) is taken for lost, and left for another, once max_outstanding_pings go unanswered: within "
        "(max_outstanding_pings + 1) * ping_interval_s, 15 s by default.",
    )
    max_outstanding_pings: int = Field(
        default=2, ge=1, le=100, description="Unanswered PINGs after which a connection is taken for lost."
    )
    outage_limit_s: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="How long a long-running process (daemon, rebuild, reactors, serve, spark follow) waits out a "
        "dependency (NATS, PostgreSQL) that is unreachable, restarting or silent before it gives up; None: for ever.",
    )
    storage_dir: Path | None = Field(default=None, description="Embedded server's storage; None: a temporary directory.")
    sync_always: bool = Field(default=False, description="Embedded server fsyncs before every acknowledgement.")
    connect_name: str = Field(default="jetsourcing", description="Client name shown by the server.")

    @model_validator(mode="after")
    def _one_set_of_credentials(self) -> Self:
        check_url_credentials(self.nats_url, self)
        return self

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # The URL may carry a password or token (the other secrets are SecretStr): reprs and logs show it redacted.
        for name, value in super().__repr_args__():
            yield name, redact_url(value) if name == "nats_url" and value else value

    def require_server(self, why: str) -> Self:
        """These settings, if they name a server; else :class:`~eventstore.InvalidArgumentError` saying ``why`` an
        embedded server (which ``nats_url=None`` starts) would not do."""
        if not self.nats_url:
            raise InvalidArgumentError(f"No NATS server configured: set NATS_URL (or pass --nats-url). {why}")
        return self

"""nats-py connect options and the replays' bulk-read connection: honoured there too, or refused at ``connect()``.

The event store has two connections: nats-py's (appends, loads, the API) and
the bulk-read connection of its replays (:mod:`eventstore.jetstream.transport`).
An option given to :meth:`EventStore.connect(**connect_options)
<eventstore.EventStore.connect>`, or set on a connection given to
``EventStore(nc, ...)``, must act on both, or replays would fail (or reach the
server another way) while appends work. So each option of nats-py's
``connect()`` is in exactly one of three tables here, and a test holds the
tables to nats-py's signature:

* :data:`HONOURED`: the bulk-read connection does the same (credentials, TLS,
  the inbox prefix);
* :data:`NATS_PY_ONLY`: it only shapes nats-py's own connection (callbacks,
  reconnects, pings, buffers), the bulk-read connection has its own behaviour;
* :data:`REFUSED`: ``connect()`` raises :class:`~eventstore.InvalidArgumentError`
  naming the option and what to do instead.

``ws://`` and ``wss://`` URLs are refused too: the bulk-read connection speaks
NATS over TCP (with TLS) only.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from pydantic import SecretStr, ValidationError

from .errors import InvalidArgumentError
from .security import ConnectionSecurity, ReplaySecurity, _split_userinfo, redact_url

__all__ = ["HONOURED", "NATS_PY_ONLY", "REFUSED", "check_tcp_urls", "options_of", "replay_security"]

HONOURED: Final = frozenset({
    "user", "password", "token", "nkeys_seed", "user_credentials", "tls", "tls_hostname", "tls_handshake_first",
    "inbox_prefix",
})
"""Options the bulk-read connection honours too."""

NATS_PY_ONLY: Final = frozenset({
    "error_cb", "disconnected_cb", "closed_cb", "discovered_server_cb", "reconnected_cb", "lame_duck_mode_cb",
    "reconnect_to_server_handler", "name", "pedantic", "verbose", "allow_reconnect", "connect_timeout",
    "reconnect_time_wait", "max_reconnect_attempts", "ping_interval", "max_outstanding_pings", "dont_randomize",
    "flusher_queue_size", "no_echo", "drain_timeout", "pending_size", "flush_timeout", "skip_subject_validation",
})
"""Options that shape only nats-py's connection: the bulk-read connection does not need them to reach the server."""

REFUSED: Final = {
    "servers": "set the server URL(s) in EventStoreSettings.nats_url (NATS_URL) instead",
    "signature_cb": "pass nkeys_seed= (an nkey seed file) or user_credentials= (a .creds file), or set "
                    "nkey_seed_file or credentials_file in the settings: replays sign the server's nonce themselves",
    "user_jwt_cb": "pass user_credentials= (a .creds file), or set credentials_file in the settings",
    "nkeys_seed_str": "write the seed to a file and pass nkeys_seed= its path (or set nkey_seed_file)",
    "ws_connection_headers": "connect to the server's nats:// (or tls://) client port: replays do not speak websocket",
}
"""Options ``connect()`` refuses, each with what to do instead."""


def _refuse(option: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"The connect option {option}= cannot be used: the replays' bulk-read connection could not honour it, so "
        f"appends would work and replays fail. {why[0].upper()}{why[1:]}."
    )


def check_tcp_urls(urls: str | None) -> None:
    """Raise :class:`InvalidArgumentError` if one of ``urls`` (comma-separated) is a websocket URL."""
    for url in (urls or "").split(","):
        scheme = _split_userinfo(url)[0].lower()
        if scheme in ("ws://", "wss://"):
            raise InvalidArgumentError(
                f"The server URL {redact_url(url.strip())} cannot be used: replays (read_all, subscribe, rebuilds, daemons) speak "
                "NATS over TCP only, not websocket. Use the server's client port with nats:// (or tls://)."
            )


def replay_security(security: ConnectionSecurity, options: Mapping[str, Any]) -> ReplaySecurity:
    """How the bulk-read connection connects: ``security`` (the settings), then ``options`` (nats-py connect keyword
    arguments; None values are ignored) applied on top, as nats-py applies them to its own connection.

    Raises :class:`InvalidArgumentError` naming an option that is not nats-py's, that :data:`REFUSED` holds, whose
    value replays cannot use (a callback for a password, a (jwt, seed) pair), or that conflicts with the settings.
    """
    fields: dict[str, Any] = {name: getattr(security, name) for name in ConnectionSecurity.model_fields}
    for option, value in options.items():
        if option in REFUSED:
            if value is not None:
                raise _refuse(option, REFUSED[option])
        elif option not in HONOURED and option not in NATS_PY_ONLY:
            raise InvalidArgumentError(
                f"{option}= is not an option of nats-py's connect(): check its spelling (the options are listed at "
                "nats.aio.client.Client.connect)."
            )
        elif option in HONOURED and value is not None and value is not False:
            fields.update(_honoured(option, value))
    try:
        return ReplaySecurity(**fields)
    except ValidationError as exc:
        problems = "; ".join(str(error["msg"]).removeprefix("Value error, ") for error in exc.errors())
        raise InvalidArgumentError(f"The connect options and the settings do not fit together: {problems}") from None


def _honoured(option: str, value: Any) -> dict[str, Any]:
    """The :class:`ReplaySecurity` fields for one honoured option."""
    if option in ("user", "password", "token"):
        if not isinstance(value, str):
            raise _refuse(option, f"pass {option} as a str (replays cannot call a callback for it)")
        return {option: SecretStr(value) if option != "user" else value}
    if option in ("nkeys_seed", "user_credentials"):
        if not isinstance(value, str | Path):
            raise _refuse(option, f"pass {option} as the path of a file (a .creds file for user_credentials)")
        return {"nkey_seed_file" if option == "nkeys_seed" else "credentials_file": Path(value)}
    if option == "tls":
        if not isinstance(value, ssl.SSLContext):
            raise InvalidArgumentError(f"tls= must be an ssl.SSLContext, not {type(value).__name__}.")
        return {"tls": value}
    if option == "inbox_prefix":
        return {"inbox_prefix": value.decode() if isinstance(value, bytes | bytearray) else str(value)}
    return {option: value}  # tls_hostname, tls_handshake_first


def options_of(nc: Any) -> dict[str, Any]:
    """The honoured options a nats-py connection was connected with, as far as its public ``options`` show them."""
    options = getattr(nc, "options", None) or {}
    return {k: options.get(k) for k in ("user", "password", "token", "tls", "tls_hostname", "tls_handshake_first")}

"""The NATS connection the event store uses: nats-py's client with a faster header parser.

This is the one module that touches nats-py's private members (its hooks are
listed in :data:`HOOKS`, and a test fails on a nats-py release outside
:data:`TESTED_NATS_PY`, which the package's pin names too). Replays do not go
through nats-py at all (see :mod:`eventstore.jetstream.transport`).

nats-py checks every character of every header name with a Python generator
(``any(c.isspace() for c in key)``); an entity load reads about ten headers per
commit. This subclass parses the same header block with
:func:`eventstore.native.parse_header_lines` and returns the same dictionary.

It also gives up at once on a first connection that retrying cannot fix (the
server rejected the credentials, or TLS failed), where nats-py would retry until
its attempts run out and then report "no servers available"; it refuses a
server without TLS when TLS was asked for; and it bounds the whole first
connection, which nats-py does not: each attempt may wait ``connect_timeout``
for each step of the handshake (INFO, TLS, PONG), and a server that accepts the
connection but stays silent would be tried again for every attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any

from nats.aio.client import Client
from nats.errors import SecureConnWantedError

from .errors import AuthenticationError
from .security import redact_url
from .native import parse_header_lines

__all__ = ["Connection", "HOOKS", "TESTED_NATS_PY", "connect", "parse_header_lines"]

TESTED_NATS_PY = ("2.16",)
"""The nats-py releases (major.minor) these hooks were tested against."""

HOOKS = ("_parse_header_lines", "_process_info", "_current_server", "_error_cb", "options")
"""The members of nats-py's ``Client`` this module relies on beyond its documented API."""

log = logging.getLogger("jetsourcing.eventstore")

_CLOSE_AFTER_FAILURE_S = 0.5


def _hopeless(exc: Exception) -> str | None:
    """Why a failed connection attempt will fail the same way again, or None if a retry may help."""
    if "authorization violation" in str(exc).lower():
        return (
            "the server rejected the credentials (Authorization Violation). Check the user and password, token, "
            "nkey_seed_file or credentials_file settings (JETSOURCING_*), or the credentials in the URL"
        )
    if isinstance(exc, SecureConnWantedError):
        return (
            "the server does not require TLS, but a tls:// URL or the tls_* settings ask for it, so nothing was "
            "sent to it. Enable TLS on the server, or check the URL"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"the server's TLS certificate could not be verified ({exc.verify_message}). Set tls_ca_file "
            "(JETSOURCING_TLS_CA_FILE) to the CA that signed it, and tls_hostname if it names another host than the URL"
        )
    if type(exc) is ssl.SSLError:  # a TLS alert; its subclasses are lost or reset connections
        return (
            f"the TLS handshake failed ({exc.reason or exc}). If the server requires a client certificate, set "
            "tls_cert_file and tls_key_file (JETSOURCING_TLS_CERT_FILE, JETSOURCING_TLS_KEY_FILE) to one its CA signed"
        )
    return None


class Connection(Client):
    """A nats-py client with a faster :func:`parse_header_lines` and :meth:`open`, a connect that fails fast."""

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        return parse_header_lines(raw)

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        # nats-py upgrades to TLS only when the server requires it: a server that does not would get
        # the CONNECT, credentials included, in plain text although TLS was asked for.
        server = self._current_server
        if (
            initial_connection
            and server is not None
            and server.uri.scheme in ("nats", "tls")  # a wss:// server's TLS is the websocket's
            and (server.uri.scheme == "tls" or "tls" in self.options)
            and not info.get("tls_required")
        ):
            raise SecureConnWantedError()
        await super()._process_info(info, initial_connection)

    async def open(self, servers: list[str], *, deadline_s: float | None = None, **options: Any) -> None:
        """Connect as nats-py's ``connect()`` does, but raise :class:`AuthenticationError` at once when retrying cannot help.

        That is when the server rejects the credentials, the TLS handshake
        fails, or TLS was asked for (a ``tls://`` URL, a ``tls`` context) and
        the server does not require it; other failures are retried as
        ``options`` say. ``error_cb`` still sees every error of the first
        attempts; without one, they are logged at debug level only (nats-py's
        default logs a traceback per attempt), since the failed connect raises
        one error that names the last of them. In a cluster, one server
        failing so ends the attempt: the others share its credentials and CA.

        With ``deadline_s``, all attempts together end within it (plus a
        bounded close): :class:`TimeoutError` then says no server answered.
        """
        hopeless: list[str] = []
        last_error: list[Exception] = []
        # Once connected, an error_cb of the caller's, or else nats-py's default (it logs the error).
        callback = options.get("error_cb") or self._error_cb
        quiet = "error_cb" not in options

        async def on_error(exc: Exception) -> None:
            last_error[:] = [exc]
            if hopeless:
                return  # closing after giving up: nothing the caller needs to hear
            reason = _hopeless(exc)
            if reason is not None:
                hopeless.append(reason)
                self.options["allow_reconnect"] = False  # nats-py then raises instead of trying again
            if quiet:
                log.debug("NATS connection attempt failed: %s", exc or type(exc).__name__)
            else:
                await callback(exc)

        try:
            async with asyncio.timeout(deadline_s) as deadline:
                await self.connect(servers, **{**options, "error_cb": on_error})
        except Exception as exc:
            if not hopeless and not deadline.expired():
                raise
            await self._close_after_failure()
            if not hopeless:
                why = f" (last error: {last_error[0] or type(last_error[0]).__name__})" if last_error else ""
                raise TimeoutError(f"no server answered within {deadline_s}s{why}") from exc
            where = redact_url(",".join(servers))
            raise AuthenticationError(f"Could not connect to NATS at {where}: {hopeless[0]}.") from exc
        finally:
            self._error_cb = callback  # connected (or given up): errors from now on are the caller's


    def reconnect_forever(self) -> None:
        """From now on, reconnect after a lost connection until closed (the first connect's attempts were bounded)."""
        self.options["max_reconnect_attempts"] = -1

    async def _close_after_failure(self) -> None:
        # Bounded: after a failed TLS handshake asyncio has closed the socket but never tells
        # the stream nats-py waits on, so its close() would wait forever.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_CLOSE_AFTER_FAILURE_S):
                await self.close()


async def connect(servers: list[str], *, deadline_s: float | None = None, **options: Any) -> Connection:
    """Connect a :class:`Connection` like :func:`nats.connect` does, failing as :meth:`Connection.open` does."""
    nc = Connection()
    await nc.open(servers, deadline_s=deadline_s, **options)
    return nc

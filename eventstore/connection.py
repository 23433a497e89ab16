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

And its flushes (:func:`flush`) can give up without breaking the connection.
nats-py 2.16 keeps one future per PING sent and sets the oldest one's result
when a PONG comes, without checking it is still pending: a flush that timed
out (its own ``timeout``, or a cancellation) left a cancelled future there, so
the late PONG raises ``InvalidStateError`` and ends nats-py's read loop. The
connection then looks connected while nothing arrives, until its unanswered
PINGs (``max_outstanding_pings``, every ``ping_interval``) make nats-py drop
it: a one-second stall cost about fourteen seconds (nats.py issue #624).
:func:`flush` never lets nats-py give up while the PONG may still come, and
:class:`Connection` flushes so, which covers the flushes nats-py makes itself
(``Subscription.drain``, ``Client.drain``, a reconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
from typing import Any

from nats.aio.client import DEFAULT_FLUSH_TIMEOUT, DEFAULT_MAX_OUTSTANDING_PINGS, DEFAULT_PING_INTERVAL, Client
from nats.errors import BadTimeoutError, FlushTimeoutError, SecureConnWantedError

from .errors import AuthenticationError
from .security import redact_url
from .native import parse_header_lines

__all__ = ["Connection", "HOOKS", "TESTED_NATS_PY", "connect", "flush", "parse_header_lines"]

TESTED_NATS_PY = ("2.16",)
"""The nats-py releases (major.minor) these hooks were tested against."""

HOOKS = ("_parse_header_lines", "_process_info", "_current_server", "_error_cb", "options")
"""The members of nats-py's ``Client`` this module relies on beyond its documented API."""

log = logging.getLogger("jetsourcing.eventstore")

_CLOSE_AFTER_FAILURE_S = 0.5

_flushing: set[asyncio.Future[None]] = set()
"""nats-py flushes still waiting for their PONG: referenced here until they end, as a caller may have given up."""


async def flush(nc: Client, timeout_s: float) -> None:
    """Wait until the server has processed everything sent on ``nc`` so far (a PING answered), at most ``timeout_s``.

    Raises nats-py's ``FlushTimeoutError`` (an ``asyncio.TimeoutError``) when
    no PONG came in time, as ``nc.flush`` does; but unlike ``nc.flush``, a
    flush that times out or is cancelled leaves the connection working (see
    the module). Works on any nats-py ``Client``, one the caller made included.
    """
    if timeout_s <= 0:
        raise BadTimeoutError
    # nats-py cancels its PING's future when its own timeout ends, so that timeout must outlast every PONG
    # that can still come: past (max_outstanding_pings + 1) unanswered pings nats-py drops the connection,
    # and a reconnect starts a new list of pending PINGs (the old future is then out of reach). Twice that
    # leaves room for the pings answered late before ours, in order.
    pings = nc.options.get("max_outstanding_pings", DEFAULT_MAX_OUTSTANDING_PINGS)
    patience_s = max(timeout_s, 2 * (pings + 1) * nc.options.get("ping_interval", DEFAULT_PING_INTERVAL))
    pinging = asyncio.ensure_future(Client.flush(nc, timeout=math.ceil(patience_s)))
    _flushing.add(pinging)
    pinging.add_done_callback(_flushed)
    # asyncio.wait, not a timeout around the flush: giving up (or being cancelled) must not cancel it.
    await asyncio.wait({pinging}, timeout=timeout_s)
    if not pinging.done():
        raise FlushTimeoutError
    pinging.result()


def _flushed(pinging: asyncio.Future[None]) -> None:
    _flushing.discard(pinging)
    if not pinging.cancelled():
        pinging.exception()  # retrieved: a flush given up on may end in a timeout nobody waits for


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


    async def flush(self, timeout: float = DEFAULT_FLUSH_TIMEOUT) -> None:
        """nats-py's flush, except that one that times out or is cancelled leaves the connection working.

        nats-py's own drains and reconnects flush through this method too (see :func:`flush`).
        """
        await flush(self, timeout)

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

"""The bulk-read connection: a NATS client of its own, on asyncio's Protocol API, for replays.

A replay receives hundreds of thousands of messages a second on one
subscription. nats-py builds a ``Msg`` object, parses its headers with a
per-character check and runs a callback per message; :class:`BulkConnection`
frames each socket read (up to 256 KiB) in one pass instead and hands the runs
of a subscription's messages over as raw bytes, to a :class:`Receiver` that
checks them in bulk (see :mod:`eventstore.jetstream.replay`). A receiver may
bring a native scanner that frames whole runs of its messages at once.

It speaks the small part of the client protocol a replay needs: the
handshake (TLS, every way of authenticating the event store supports), PING,
SUB/UNSUB, PUB and requests. Like nats-py it tries its servers from a shuffled
pool that learns the cluster's (:mod:`.pool`) and PINGs to notice a silent
peer (:mod:`.keepalive`). It does not reconnect: a replay opens a new one
(:mod:`.shared`) and resumes after the last message it handed over.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
import secrets
import ssl
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nkeys

from ..errors import AuthenticationError, ServerUnavailableError
from ..security import ConnectionSecurity, redact_url, tls_context
from .keepalive import Keepalive
from .pool import ServerPool
from .receivers import Raw, Receiver, Replies, Run

__all__ = ["BulkConnection", "Raw", "Receiver", "Run"]

log = logging.getLogger("jetsourcing.eventstore")

_MAX_CONTROL_LINE = 4096
_PERMISSION = re.compile(r'permissions violation for (publish|subscription) to "?([^"\s]+)', re.IGNORECASE)


def _creds_part(text: str, what: str) -> str:
    """The block of a .creds file after its ``-----BEGIN <what>-----`` line."""
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("-----BEGIN") and what in line:
            for value in lines[i + 1 :]:
                if value and not value.startswith("---"):
                    return value
    raise ValueError(f"no {what} block")


class BulkConnection(asyncio.Protocol):
    """One NATS connection for bulk reads (see the module docs). Open it with :meth:`open`."""

    def __init__(self, security: ConnectionSecurity, name: str, inbox_prefix: str = "_INBOX") -> None:
        self._security = security
        self._name = name
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._need = 0  # bytes the incomplete message in _buf needs, when known
        self._subs: dict[bytes, Receiver] = {}
        self._next_sid = 0
        self._lines: asyncio.Queue[bytes] = asyncio.Queue()
        self._handshaking = True
        self._pongs: list[asyncio.Future[None] | None] = []  # per PING sent, in order; None: the keepalive's
        self._keepalive: Keepalive | None = None
        self._pool: ServerPool | None = None
        self._origin = ""
        self._lost: Exception | None = None
        self._lost_cause: Exception | None = None
        self._inbox = f"{inbox_prefix}.{secrets.token_hex(11)}"
        self._subjects: dict[bytes, str] = {}  # what each subscription (by id) and request (by token) is on
        self._refusals: set[str] = set()
        self._replies = Replies(f"{self._inbox}.".encode())
        self._requests = 0
        self._reads = 0  # socket reads so far: a request that times out with none since it was sent is suspect
        self.suspect = False
        """A request went unanswered while nothing at all arrived: the connection may be half-open (a lost host,
        a partition); :class:`SharedConnection` checks it with a PING before handing it out again."""
        self.url = ""

    # -- opening -------------------------------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        servers: list[str],
        security: ConnectionSecurity,
        *,
        deadline_s: float,
        name: str = "jetsourcing-replay",
        inbox_prefix: str = "_INBOX",
        ping_interval_s: float | None = None,
        max_outstanding_pings: int = 2,
        pool: ServerPool | None = None,
    ) -> BulkConnection:
        """Connect to the first of ``servers`` that answers, all tries within ``deadline_s``.

        The servers are tried in random order, then those the cluster
        advertised (``pool``, which the connection keeps up to date from the
        server's INFO), each try within its share of the time left, so that a
        silent server leaves time for the next (:mod:`~eventstore.jetstream.pool`).
        Replies come to subjects under ``inbox_prefix`` (nats-py's option of that name).

        With ``ping_interval_s``, the connection PINGs the server that often and
        fails (as a lost connection) when more than ``max_outstanding_pings``
        go unanswered (:mod:`~eventstore.jetstream.keepalive`).

        Raises :class:`AuthenticationError` when a server refuses the
        credentials or TLS fails (retrying cannot help), else
        :class:`ServerUnavailableError` naming the servers and the last error.
        """
        last: BaseException | None = None
        pool = pool or ServerPool()
        tries = pool.candidates(servers)
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        try:
            async with asyncio.timeout(deadline_s):
                for i, candidate in enumerate(tries):
                    self = cls(security, name, inbox_prefix)
                    self._pool = pool
                    try:
                        async with asyncio.timeout((end - loop.time()) / (len(tries) - i)):
                            await self._connect(candidate.url, candidate.tls_name)
                        if ping_interval_s is not None:
                            self._keepalive = Keepalive(
                                interval_s=ping_interval_s, max_outstanding=max_outstanding_pings,
                                ping=self._ping, reads=lambda: self._reads, dead=self._fail,
                            )
                        return self
                    except (OSError, ServerUnavailableError, ValueError) as exc:
                        self.close()
                        if isinstance(exc, AuthenticationError):
                            raise
                        last = exc
                    except BaseException:  # the deadline, or the caller cancelled: nothing of the try stays open
                        self.close()
                        raise
        except TimeoutError as exc:
            last = last or exc
        where = redact_url(",".join(servers))
        raise ServerUnavailableError(
            f"Could not connect to NATS at {where} within {deadline_s}s ({last or type(last).__name__}). "
            "Check that the server is up and reachable."
        ) from last

    async def _connect(self, url: str, tls_name: str | None = None) -> None:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        self.url = redact_url(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 4222
        loop = asyncio.get_running_loop()
        await loop.create_connection(lambda: self, host, port)
        context = tls_context(self._security)
        first = bool(getattr(self._security, "tls_handshake_first", False))  # ReplaySecurity's (nats-py's option)
        if first:  # TLS at once: the server sends its INFO over it
            hostname = self._security.tls_hostname or tls_name or host
            assert self._transport is not None
            try:
                self._transport = await loop.start_tls(
                    self._transport, self, context or ssl.create_default_context(), server_hostname=hostname
                )
            except ssl.SSLError as exc:
                raise AuthenticationError(f"Could not connect to NATS at {self.url}: the TLS handshake failed ({exc}).") from exc
        info = json.loads((await self._line(b"INFO "))[5:])
        wants_tls = parts.scheme == "tls" or context is not None
        if wants_tls and not info.get("tls_required") and not first:
            raise AuthenticationError(
                f"Could not connect to NATS at {self.url}: the server does not require TLS, but a tls:// URL or the "
                "tls_* settings ask for it, so nothing was sent to it. Enable TLS on the server, or check the URL."
            )
        if info.get("tls_required") and not first:
            context = context or ssl.create_default_context()
            hostname = self._security.tls_hostname or tls_name or host
            assert self._transport is not None
            try:
                self._transport = await loop.start_tls(self._transport, self, context, server_hostname=hostname)
            except ssl.SSLError as exc:
                raise AuthenticationError(f"Could not connect to NATS at {self.url}: the TLS handshake failed ({exc}).") from exc
        connect = self._connect_options(info, parts.username, parts.password)
        self._write(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        answer = await self._line(b"PONG", b"-ERR")
        if answer.startswith(b"-ERR"):
            why = answer[5:].decode(errors="replace").strip(" '")
            if "authorization" in why.lower():
                raise AuthenticationError(
                    f"Could not connect to NATS at {self.url}: the server rejected the credentials ({why}). Check "
                    "the user and password, token, nkey_seed_file or credentials_file settings, or the URL's."
                )
            raise ServerUnavailableError(f"NATS at {self.url} refused the connection ({why}).")
        self._handshaking = False
        if self._pool is not None:
            self._pool.learn(info, url)
            self._origin = url
        if self._buf:  # messages right behind the PONG
            self.data_received(b"")
        self.subscribe_inbox()

    def _connect_options(self, info: dict[str, object], user: str | None, password: str | None) -> dict[str, object]:
        options: dict[str, object] = {
            "verbose": False, "pedantic": False, "lang": "python3", "version": "jetsourcing", "protocol": 1,
            "headers": True, "no_responders": True, "name": self._name,
            "tls_required": bool(info.get("tls_required")),
        }
        security = self._security
        if user is not None and password is not None:
            options.update(user=unquote(user), **{"pass": unquote(password)})
        elif user is not None:
            options["auth_token"] = unquote(user)
        if security.user is not None and security.password is not None:
            options.update(user=security.user, **{"pass": security.password.get_secret_value()})
        if security.token is not None:
            options["auth_token"] = security.token.get_secret_value()
        nonce = str(info.get("nonce") or "").encode()
        if security.nkey_seed_file is not None:
            pair = nkeys.from_seed(bytearray(Path(security.nkey_seed_file).read_bytes().strip()))
            options.update(nkey=pair.public_key.decode(), sig=base64.b64encode(pair.sign(nonce)).decode())
        if security.credentials_file is not None:
            text = Path(security.credentials_file).read_text()
            pair = nkeys.from_seed(bytearray(_creds_part(text, "NKEY SEED").encode()))
            options.update(jwt=_creds_part(text, "JWT"), sig=base64.b64encode(pair.sign(nonce)).decode())
        return options

    async def _line(self, *starts: bytes) -> bytes:
        """The next handshake line that begins with one of ``starts`` (PINGs are answered, others skipped)."""
        while True:
            line = await self._lines.get()
            if not line:
                if isinstance(self._lost_cause, ssl.SSLError):  # TLS 1.3 refuses a client certificate after its handshake
                    raise AuthenticationError(
                        f"Could not connect to NATS at {self.url}: the TLS handshake failed "
                        f"({self._lost_cause.reason or self._lost_cause}). If the server requires a client "
                        "certificate, set tls_cert_file and tls_key_file to one its CA signed."
                    )
                raise self._lost or ServerUnavailableError(f"NATS at {self.url} closed the connection.")
            if line.startswith(starts):
                return line

    # -- the protocol --------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost_cause = exc
        error = ServerUnavailableError(
            f"The replay connection to NATS at {self.url} was lost ({exc or 'closed by the server'})."
        )
        self._lost = self._lost or error
        self._transport = None
        if self._keepalive is not None:
            self._keepalive.stop()
        for receiver in list(self._subs.values()):
            receiver.lost(self._lost)
        for future in self._pongs:
            if future is not None and not future.done():
                future.set_exception(self._lost)
        self._pongs.clear()
        self._lines.put_nowait(b"")  # ends a handshake waiting for a line

    def data_received(self, data: bytes) -> None:
        self._reads += 1
        if self._handshaking:
            self._buf += data
            while (eol := self._buf.find(b"\r\n")) >= 0 and self._handshaking:
                line = bytes(self._buf[:eol])
                del self._buf[: eol + 2]
                if line == b"PING":
                    self._write(b"PONG\r\n")
                else:
                    self._lines.put_nowait(line)
                    if line == b"PONG":
                        break  # what follows is the connected protocol's
            return
        if self._buf:
            self._buf += data
            if len(self._buf) < self._need:
                return  # the message begun needs more (one copy of a big message, not one per read)
            view = bytes(self._buf)
        else:
            view = data
        received: dict[Receiver, list[Raw]] = {}
        malformed = False
        try:
            pos = self._frame(view, received)
        except ValueError:  # a length that is not a number, or too few or many fields: not the protocol
            malformed, pos = True, len(view)
        self._buf = bytearray(view[pos:])
        self._need = _needed(self._buf)
        for receiver, rows in received.items():
            if rows:
                receiver.add(rows)
            receiver.wake()
        if malformed:
            self._fail("a malformed message line")

    def _frame(self, view: bytes, received: dict[Receiver, list[Raw]]) -> int:
        """Frame the complete operations of ``view`` and hand them on; returns where the incomplete rest starts."""
        pos, size, find, subs = 0, len(view), view.find, self._subs
        rows: list[Raw] = []
        current: bytes | None = None
        scan: Callable[[bytes, int], tuple[int, Run | None]] | None = None
        while pos < size:
            # HMSG <subject> <sid> [reply-to] <header bytes> <total bytes>, or MSG <subject> <sid> [reply-to] <bytes>
            headered = view.startswith(b"HMSG ", pos)
            if headered or view.startswith(b"MSG ", pos):
                # Read as the native scanner reads it (see _message_line): the line ends at its first CR.
                eol = find(b"\r", pos)
                if (size if eol < 0 else eol) - (pos + 4 + headered) >= _MAX_CONTROL_LINE:
                    raise ValueError(view[pos : pos + 64])
                if eol < 0 or eol + 1 == size:
                    break
                subject, sid, reply, start, split, end = _message_line(view, pos, eol, headered)
            else:
                eol = find(b"\r\n", pos)
                if eol < 0:
                    if size - pos > _MAX_CONTROL_LINE:
                        self._fail(f"a protocol line longer than {_MAX_CONTROL_LINE} bytes")
                        return size
                    break
                self._control(view[pos:eol])
                pos = eol + 2
                continue
            if end + 2 > size:
                break
            if view[end : end + 2] != b"\r\n":
                raise ValueError(view[pos:eol])  # the size does not end where the message does
            if sid != current:
                receiver = subs.get(sid)
                current = sid if receiver is not None else None
                if receiver is None:
                    pos = end + 2
                    continue  # a subscription already dropped
                rows = received.setdefault(receiver, [])
                scan = receiver.scan
                if scan is not None:
                    # The scanner takes whole runs of this subscription's messages, starting with this one.
                    pos, run = scan(view, pos)
                    if run is not None:
                        if rows:
                            receiver.add(rows)
                            received[receiver] = rows = []
                        receiver.add_run(run)
                        current = None
                        continue
            rows.append((subject, reply, view[start:split], view[split:end]))
            pos = end + 2
            if scan is not None:
                current = None  # let the scanner try the next message again
        return pos

    def _control(self, line: bytes) -> None:
        if line == b"PING":
            self._write(b"PONG\r\n")
        elif line == b"PONG":
            if self._keepalive is not None:
                self._keepalive.answered()
            if self._pongs:
                future = self._pongs.pop(0)
                if future is not None and not future.done():
                    future.set_result(None)
        elif line.startswith(b"-ERR"):
            why = line[5:].decode(errors="replace").strip(" '")
            if "permissions violation" in why.lower():
                self._refused(why)  # the server keeps the connection (nats-py's _process_err does the same)
            else:
                self._fail(f"the server said {why}")
        elif line.startswith(b"INFO ") and self._pool is not None:  # the cluster changed: servers to fail over to
            with contextlib.suppress(ValueError):
                self._pool.learn(json.loads(line[5:]), self._origin)
        # +OK needs nothing

    def _fail(self, why: str) -> None:
        self._lost = ServerUnavailableError(f"The replay connection to NATS at {self.url} failed: {why}.")
        if self._transport is not None:
            self._transport.abort()

    def _refused(self, why: str) -> None:
        """Fail what the server refused for want of a permission (:class:`AuthenticationError`: asking again cannot
        help), logged once per refusal; the rest of the connection goes on."""
        error = AuthenticationError(
            f"NATS at {self.url} refused a replay: {why}. The user lacks a permission the event store needs: allow "
            f"it in the server's authorization (replays publish to $JS.API.> and subscribe to {self._inbox.rpartition('.')[0]}.>), "
            "or give the connection an inbox_prefix the user may subscribe to."
        )
        if why not in self._refusals:
            self._refusals.add(why)
            log.warning("%s", error)
        found = _PERMISSION.search(why)
        refused = found.group(2) if found else None
        for key, subject in list(self._subjects.items()):
            if subject != refused:
                continue
            if key == b"0":  # the replies' subscription: no request can be answered here
                self.close(error)
            elif (future := self._replies.waiting.pop(key, None)) is not None and not future.done():
                future.set_exception(error)
            elif (receiver := self._subs.pop(key, None)) is not None:
                receiver.lost(error)

    def _ping(self) -> None:
        self._pongs.append(None)
        self._write(b"PING\r\n")

    def _write(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            raise self._lost or ServerUnavailableError(f"The replay connection to NATS at {self.url} is closed.")
        self._transport.write(data)

    # -- the client ----------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the connection is gone (closed, lost or failed); a closed one stays closed."""
        return self._transport is None or self._transport.is_closing()

    def new_inbox(self) -> str:
        """A subject no one else subscribes to."""
        return f"{self._inbox}.s{secrets.token_hex(6)}"

    def subscribe(self, subject: str, receiver: Receiver) -> bytes:
        """Deliver the messages of ``subject`` to ``receiver``; the subscription's id, for :meth:`unsubscribe`."""
        self._next_sid += 1
        sid = str(self._next_sid).encode()
        self._subs[sid] = receiver
        self._subjects[sid] = subject
        self._write(b"SUB " + subject.encode() + b" " + sid + b"\r\n")
        return sid

    def subscribe_inbox(self) -> None:
        self._subs[b"0"] = self._replies
        self._subjects[b"0"] = f"{self._inbox}.r.*"
        self._write(f"SUB {self._inbox}.r.* 0\r\n".encode())

    def unsubscribe(self, sid: bytes) -> None:
        """Stop delivering to the subscription (messages already in the socket's buffer are dropped)."""
        self._subjects.pop(sid, None)
        if self._subs.pop(sid, None) is not None and not self.closed:
            self._write(b"UNSUB " + sid + b"\r\n")

    def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        """Send a message (buffered by the transport; raises :class:`ServerUnavailableError` when closed)."""
        head = f"PUB {subject} {reply} {len(payload)}\r\n" if reply else f"PUB {subject} {len(payload)}\r\n"
        self._write(head.encode() + payload + b"\r\n")

    async def request(self, subject: str, payload: bytes, timeout_s: float) -> Raw:
        """Send a request and wait for its reply, at most ``timeout_s`` (:class:`TimeoutError`; the connection is
        then :attr:`suspect` if nothing at all arrived meanwhile)."""
        self._requests += 1
        reads = self._reads
        token = f"r.{self._requests}"
        future: asyncio.Future[Raw] = asyncio.get_running_loop().create_future()
        self._replies.waiting[token.encode()] = future
        self._subjects[token.encode()] = subject
        try:
            self.publish(subject, payload, f"{self._inbox}.{token}")
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            if self._reads == reads:
                self.suspect = True
            raise
        finally:
            self._replies.waiting.pop(token.encode(), None)
            self._subjects.pop(token.encode(), None)

    async def flush(self, timeout_s: float) -> None:
        """Wait until the server has processed everything sent so far (a PING answered)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pongs.append(future)
        self._write(b"PING\r\n")
        async with asyncio.timeout(timeout_s):
            await future

    def close(self, error: Exception | None = None) -> None:
        """Close the connection at once (nothing sent is waited for).

        With ``error``, everything waiting on the connection (requests, flushes,
        subscriptions) fails with it now, not when the transport reports the
        socket closed, and so does every later use.
        """
        if error is not None:
            self._lost = error
            for receiver in list(self._subs.values()):
                receiver.lost(error)
            for future in self._pongs:
                if future is not None and not future.done():
                    future.set_exception(error)
            self._pongs.clear()
        if self._keepalive is not None:
            self._keepalive.stop()
        if self._transport is not None:
            with contextlib.suppress(Exception):
                self._transport.abort()  # close() would wait to send what is buffered, for ever on a silent peer


_MAX_SIZE = 2**63 - 1


def _size(token: bytes) -> int:
    """A message line's byte count: decimal digits only, at most int64 (as ``decimal()`` in ``_native.c``)."""
    if not 0 < len(token) <= 19 or not token.isdigit() or int(token) > _MAX_SIZE:
        raise ValueError(token)
    return int(token)


def _message_line(view: bytes, pos: int, eol: int, headered: bool) -> tuple[bytes, bytes, bytes | None, int, int, int]:
    """The parts of the ``[H]MSG`` line at ``view[pos:eol]``: subject, sid, reply (or None), where the header block,
    the body and the message's end are. Raises ValueError for anything nats-server does not send, as the native
    scanner refuses it: a CR without LF, another count of fields, a size that is not a decimal count (``MSG a 9 -40``
    would send framing backwards) or a header block past the total."""
    if view[eol + 1] != 10:
        raise ValueError(view[pos:eol])
    # Runs of spaces are one separator, as for nats-py, but the subject is what precedes the first space, as for the
    # scanner: "HMSG  1 ..." has an empty subject for both (not the subject "1").
    subject, *rest = view[pos + 4 + headered : eol].split(b" ")
    parts = [subject, *(part for part in rest if part)]
    if not 3 + headered <= len(parts) <= 4 + headered:
        raise ValueError(view[pos:eol])
    start = eol + 2
    end = start + _size(parts[-1])
    split = start + _size(parts[-2]) if headered else start
    if split > end:
        raise ValueError(view[pos:eol])
    return parts[0], parts[1], parts[2] if len(parts) == 4 + headered else None, start, split, end


def _needed(buf: bytearray) -> int:
    """The size the message begun in ``buf`` will have, with its line end; 0 when that is not known yet (or the
    line is malformed: framing then refuses it)."""
    headered = buf.startswith(b"HMSG ")
    if not (headered or buf.startswith(b"MSG ")):
        return 0
    eol = buf.find(b"\r")
    if eol < 0 or eol + 1 == len(buf):
        return 0
    try:
        return _message_line(bytes(buf[: eol + 2]), 0, eol, headered)[5] + 2
    except ValueError:
        return 0

"""Hostile bytes from a server: the bulk-read connection's Python framing and the native scanner agree.

A replay's messages are framed either natively (``eventstore/_native.c`` takes
the runs of the consumer's messages it can check) or in Python (the
connection's framing, then the replay's reply parsing). Both are fed here the
same byte strings, arbitrary ones and near-valid hostile ones (negative, huge
and wrong sizes, missing line ends, header blocks longer than the message,
gaps, odd separators), whole and split at every byte boundary: they must hand
over the same messages and end in the same state, or refuse the bytes the same
way (the connection fails naming a malformed message line). Nothing may loop.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from eventstore import ConnectionSecurity, ServerUnavailableError, native
from eventstore.jetstream import BulkConnection, Commits, OrderedReplay, Parsed
from eventstore.reading import _SCANNER
from eventstore.wire import parse_header_lines

SID = b"1"  # the connection's first subscription
ACK = b"$JS.ACK.S.C."

Outcome = tuple[object, ...]
_SECURITY = ConnectionSecurity()


async def _drive(chunks: Sequence[bytes], *, scanner: bool) -> Outcome:
    """Feed ``chunks`` to a connected :class:`BulkConnection` (a real socket pair) subscribed by a replay of
    consumer C; what the replay drained, its state, the PONGs sent and how the connection ended."""
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    conn = BulkConnection(_SECURITY, "fuzz")
    replay = OrderedReplay(lambda: asyncio.sleep(0, conn), "S", scanner=_SCANNER if scanner else None)
    try:
        await asyncio.get_running_loop().create_connection(lambda: conn, sock=ours)
        conn._handshaking = False  # the handshake is tested elsewhere; this is the connected protocol
        arrivals = replay._arrivals
        assert conn.subscribe("_INBOX.r", arrivals) == SID
        replay._consumer, replay._ack_prefix = b"C", ACK
        if scanner:
            assert _SCANNER is not None
            arrivals.scan = lambda data, pos: _SCANNER(data, pos, SID, ACK)
        drained: list[tuple[int, bytes, dict[str, str] | None, bytes]] = []
        for chunk in chunks:
            if conn.closed:
                break
            conn.data_received(chunk)
            for part in replay._drain():
                if isinstance(part, Commits):
                    blocks: list[dict[str, str] | None] = [parse_header_lines(b) for b in part.headers]
                else:
                    assert isinstance(part, Parsed)
                    blocks = list(part.headers)
                drained += zip(part.positions, part.subjects, blocks, part.bodies)
        await asyncio.sleep(0)  # the transport's writes and the abort's connection_lost
        sent = b""
        while True:
            try:
                got = peer.recv(65536)
            except BlockingIOError:
                break
            if not got:
                break
            sent += got
        error = conn._lost if conn.closed else None
        assert error is None or isinstance(error, ServerUnavailableError)
        failed = None if error is None else "malformed" in str(error)
        return (drained, replay._last_dseq, replay._pending, replay._reset, sent.count(b"PONG\r\n"), failed,
                bytes(conn._buf) if not conn.closed else b"")
    finally:
        conn.close()
        peer.close()
        await asyncio.sleep(0)


def _all_ways(data: bytes) -> None:
    """Python and native framing, the bytes whole, split in two at every boundary and byte by byte: one outcome."""
    async def main() -> None:
        reference = await _drive([data], scanner=False)
        for scanner in (False, True) if native.events is not None else (False,):
            assert await _drive([data], scanner=scanner) == reference, scanner
            for cut in range(1, len(data)):
                assert await _drive([data[:cut], data[cut:]], scanner=scanner) == reference, (scanner, cut)
            assert await _drive([data[i : i + 1] for i in range(len(data))], scanner=scanner) == reference

    asyncio.run(main())


def test_the_native_scanner_is_built() -> None:
    assert native.events is not None and _SCANNER is not None, native.ACTIVE


# -- inputs --------------------------------------------------------------------------------------------------------

# Short, so that every split of a few frames stays cheap: the scanner's framing takes any ASCII header block.
_BLOCK = b"NATS/1.0\r\nEs-Type: Opened\r\n\r\n"


def _frame(dseq: int, *, subject: bytes = b"ev.A.a", sid: bytes = SID, block: bytes = _BLOCK, body: bytes = b"{}",
           hlen: bytes | None = None, tlen: bytes | None = None, reply: bytes | None = None, sep: bytes = b" ",
           line_end: bytes = b"\r\n", tail: bytes = b"\r\n") -> bytes:
    reply = ACK + b"1.%d.%d.0.%d" % (dseq + 10, dseq, 5 - dseq) if reply is None else reply
    hlen = b"%d" % len(block) if hlen is None else hlen
    tlen = b"%d" % (len(block) + len(body)) if tlen is None else tlen
    line = sep.join(x for x in (b"HMSG", subject, sid, reply, hlen, tlen) if x is not None)
    return line + line_end + block + body + tail


_SIZES = st.sampled_from([b"-40", b"-1", b"0", b"+5", b"5_0", b"0x10", b"", b"9" * 25, b"9223372036854775807",
                          b"9223372036854775808", b"18446744073709551616", b"1e3", b"\xd9\xa5"])


@st.composite
def _hostile(draw: st.DrawFn) -> bytes:
    """Valid frames of the consumer and controls, one or two of them bent the way a hostile server might."""
    out: list[bytes] = []
    dseq = 0
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["frame", "frame", "frame", "bent", "bent", "control", "status", "other", "raw"]))
        if kind == "control":
            out.append(draw(st.sampled_from([b"PING\r\n", b"PONG\r\n", b"+OK\r\n", b"INFO {}\r\n"])))
        elif kind == "status":
            out.append(_frame(0, reply=None if draw(st.booleans()) else b"", block=b"NATS/1.0 100 Idle Heartbeat\r\n\r\n",
                              body=b"").replace(b"  ", b" "))
        elif kind == "other":
            out.append(_frame(dseq + 1, sid=b"9"))
        elif kind == "raw":
            out.append(draw(st.binary(max_size=12)))
        elif kind == "frame":
            dseq += draw(st.sampled_from([1, 1, 1, 2, 0]))  # now and then a gap or a repeat
            out.append(_frame(dseq))
        else:
            dseq += 1
            bend = draw(st.sampled_from(["hlen", "tlen", "both", "over", "tail", "line_end", "sep", "subject", "reply",
                                         "block", "msg"]))
            size = draw(_SIZES)
            length = len(_BLOCK) + 2
            out.append({
                "hlen": lambda: _frame(dseq, hlen=size),
                "tlen": lambda: _frame(dseq, tlen=size),
                "both": lambda: _frame(dseq, hlen=b"%d" % (length + 5), tlen=b"%d" % length),  # headers past the total
                "over": lambda: _frame(dseq, tlen=b"%d" % (length + draw(st.integers(-4, 4)))),
                "tail": lambda: _frame(dseq, tail=draw(st.sampled_from([b"", b"\r", b"\n", b"xx", b"\n\r"]))),
                "line_end": lambda: _frame(dseq, line_end=draw(st.sampled_from([b"\n", b"\r", b"\r\r\n", b""]))),
                "sep": lambda: _frame(dseq, sep=draw(st.sampled_from([b"  ", b"\t", b" \t", b"\x0b"]))),
                "subject": lambda: _frame(dseq, subject=draw(st.sampled_from([b"", b"ev.A\rb", b"ev.A\tb", b"ev.A b",
                                                                              b"ev.\xff.a"]))),
                "reply": lambda: _frame(dseq, reply=ACK + draw(st.sampled_from([b"1.11.+1.0.4", b"1.11.1.0", b"1.-1.1.0.4",
                                                                              b"1.11.1.0.4.9", b"x.11.1.0.4", b""]))),
                "block": lambda: _frame(dseq, block=_BLOCK.replace(draw(st.sampled_from([b"Es-Type", b"\r\n\r\n",
                                                                                         b"Opened"])), b"\xff\r")),
                "msg": lambda: b"MSG ev.A.a 1 %s\r\nhi\r\n" % size,
            }[bend]())
    return b"".join(out)


# -- tests ---------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(20)
@pytest.mark.parametrize("data", [
    b"PING\r\nMSG a 9 -40\r\n",  # backwards onto the PING: an endless loop queuing a PONG per pass
    b"PING\r\nMSG a 1 -40\r\n",
    b"HMSG ev.A.a 1 " + ACK + b"1.11.1.0.4 -30 10\r\n" + b"x" * 20 + b"\r\n",
])
def test_a_negative_size_fails_the_connection_instead_of_looping(data: bytes) -> None:
    async def main() -> None:
        drained, _, _, _, pongs, failed, _ = await _drive([data], scanner=False)
        assert (drained, pongs, failed) == ([], 1 if data.startswith(b"PING") else 0, True)

    asyncio.run(main())
    _all_ways(data)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("data", [
    _frame(1, hlen=b"%d" % (len(_BLOCK) + 5), tlen=b"%d" % (len(_BLOCK) + 2)),  # the header block past the total
    _frame(1, tail=b"xx") + _frame(2),  # no CRLF where the size says the message ends
    _frame(1, tlen=b"9" * 25) + b"PING\r\n" * 3,  # no int64: refused, not waited for
    _frame(1, line_end=b"\r") + b"PING\r\n",
    _frame(1, tlen=b"31 32"),  # a field too many
])
def test_frames_the_scanner_refuses_fail_the_connection(data: bytes) -> None:
    async def main() -> None:
        drained, _, _, _, pongs, failed, _ = await _drive([data], scanner=False)
        assert (drained, pongs, failed) == ([], 0, True)

    asyncio.run(main())
    _all_ways(data)


def test_valid_frames_are_read_the_same_both_ways() -> None:
    data = _frame(1) + b"PING\r\n" + _frame(2) + _frame(3, sid=b"9") + _frame(3)
    _all_ways(data)


@pytest.mark.parametrize("sep", [b"  ", b" \t", b"\t"])
def test_other_separators_read_the_same_both_ways(sep: bytes) -> None:
    """Runs of spaces are tolerated (the scanner leaves them to Python); a tab is part of a field for both."""
    _all_ways(_frame(1, sep=sep) + _frame(2) + _frame(3, subject=b"", sep=sep) + b"HMSG " + _frame(4)[5:].replace(b" ", b"  ", 1))


@hypothesis_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_hostile())
@example(_frame(1) + b"MSG a 9 -40\r\n")
def test_hostile_near_valid_bytes_read_the_same_both_ways(data: bytes) -> None:
    _all_ways(data)


@hypothesis_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.binary(max_size=40), st.sampled_from([b"MSG ", b"HMSG ", b"\r\n", b" ", b"7", b"-", b"PING\r\n",
                                                                  _frame(1), _frame(2), ACK])), max_size=8).map(b"".join))
def test_arbitrary_bytes_read_the_same_both_ways(data: bytes) -> None:
    _all_ways(data)

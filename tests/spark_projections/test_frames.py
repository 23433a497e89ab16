"""The native framing of bulk reads (``spark_projections/_frames.c``) against the Python framing it speeds up.

Frames are built as nats-server delivers a consumer's messages, from commits laid
out by the event store's own wire encoder; both paths must give the same Arrow
batches, and the scanner must leave every frame it does not fully understand to
the Python path.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventstore import StreamId, encode_commit
from eventstore import ConnectionSecurity
from eventstore.jetstream import BulkConnection, Commits, Raw
from spark_projections import _batches
from spark_projections.source import EVENTS_SCHEMA

SID = b"7"
CONSUMER = b"C0nsumer"
ACK_PREFIX = b"$JS.ACK.S." + CONSUMER + b"."
SUBJECT_PREFIX = "ev"
COLUMNS = tuple(EVENTS_SCHEMA.fieldNames())


def header_block(headers: dict[str, str]) -> bytes:
    """The header block as nats-py publishes it (and the server delivers it)."""
    return ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()


def frame(subject: bytes, sseq: int, dseq: int, block: bytes, body: bytes, *, sid: bytes = SID,
          ack_prefix: bytes = ACK_PREFIX, pending: int = 0) -> bytes:
    reply = ack_prefix + b"1.%d.%d.1795369933148286637.%d" % (sseq, dseq, pending)
    return b"HMSG %s %s %s %d %d\r\n%s%s\r\n" % (subject, sid, reply, len(block), len(block) + len(body), block, body)


commit_strategy = st.fixed_dictionaries(
    {
        "category": st.sampled_from(["Account", "Cart"]),
        "entity": st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=12),
        "events": st.lists(
            st.tuples(st.sampled_from(["Opened", "Deposited", "ItemAdded"]), st.integers(1, 3),
                      st.text(max_size=20)),
            min_size=1, max_size=3,
        ),
        "correlation": st.one_of(st.none(), st.text("abcdef0123456789", min_size=1, max_size=36)),
        "causation": st.one_of(st.none(), st.text("abcdef0123456789", min_size=1, max_size=36)),
        "msg_id": st.booleans(),
    }
)


def build(commits: list[dict[str, object]], first_seq: int = 1) -> tuple[bytes, Commits]:
    """The frames of ``commits`` (stream sequences 2, 4, 6, ... as after a filter) and the same as Python lists."""
    data = b""
    python = Commits()
    for i, c in enumerate(commits):
        events = c["events"]
        assert isinstance(events, list)
        headers, body = encode_commit(
            msg_id=f"m{i}", types=[e[0] for e in events], schema_versions=[e[1] for e in events],
            event_ids=[f"e{i}-{n}" for n in range(len(events))],
            payloads=[json.dumps({"text": e[2]}, ensure_ascii=False).encode() for e in events],
            last_version=7 + len(events), recorded_at=f"2026-01-0{1 + i % 9}T00:00:00.{i:06d}+00:00",
            correlation_id=c["correlation"], causation_id=c["causation"],  # type: ignore[arg-type]
        )
        if not c["msg_id"]:
            headers.pop("Nats-Msg-Id")
        subject = StreamId(str(c["category"]), str(c["entity"])).subject(SUBJECT_PREFIX).encode()
        block = header_block(headers)
        sseq = first_seq + 2 * i
        data += frame(subject, sseq, i + 1, block, body)
        python.positions.append(sseq)
        python.subjects.append(subject)
        python.headers.append(block)
        python.bodies.append(body)
    return data, python


def scan_all(data: bytes) -> tuple[int, list[_batches.Frames]]:
    pos, runs = 0, []
    while True:
        pos, run = _batches.Frames.scan(data, pos, SID, ACK_PREFIX, (SUBJECT_PREFIX + ".").encode())
        if run is None:
            return pos, runs
        runs.append(run)


def test_the_native_scanner_is_built() -> None:
    assert _batches.NATIVE, "spark_projections._frames was not built: install a C compiler and reinstall"


@settings(max_examples=150, deadline=None)
@given(st.lists(commit_strategy, min_size=1, max_size=12), st.sampled_from([COLUMNS, ("position", "type", "entity_id",
                                                                              "payload"), ("type",)]))
def test_native_and_python_framing_give_the_same_events(commits: list[dict[str, object]],
                                                          columns: tuple[str, ...]) -> None:
    data, python = build(commits)
    end, runs = scan_all(data + b"HMSG ev.Account.x 7 $JS.ACK.S.")  # and the start of a frame still in flight
    assert end == len(data) and sum(len(run) for run in runs) == len(commits)
    converter = _batches.Converter(SUBJECT_PREFIX, columns)
    native = converter.convert_frames(runs)
    assert native.to_pylist() == converter.convert(python).to_pylist()
    assert native.schema == converter.convert(python).schema


def test_runs_concatenate_and_cut_like_lists() -> None:
    commits = [{"category": "Cart", "entity": f"c{i}" * (i + 1), "events": [("Opened", 1, "x" * i)],
                "correlation": None if i % 2 else f"corr{i}", "causation": None, "msg_id": True} for i in range(9)]
    data, python = build(commits)  # type: ignore[arg-type]
    runs = []
    for part in (data[: data.index(b"HMSG", 1500)], data[data.index(b"HMSG", 1500):]):
        end, found = scan_all(part)
        assert end == len(part)
        runs += found
    assert len(runs) == 2
    converter = _batches.Converter(SUBJECT_PREFIX)
    assert converter.convert_frames(runs).to_pylist() == converter.convert(python).to_pylist()
    first = runs[0].head(2)
    assert list(first.position_list()) == python.positions[:2]
    assert converter.convert_frames([first]).to_pylist() == converter.convert(python.head(2)).to_pylist()


HEADERS = header_block({"Es-Type": "Opened", "Es-Schema-Version": "1", "Es-Event-Id": "e", "Es-Version": "1",
                        "Es-Recorded-At": "2026-01-01T00:00:00+00:00"})
GOOD = frame(b"ev.Account.a", 5, 1, HEADERS, b"{}")


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(frame(b"ev.Account.a", 6, 2, HEADERS, b"{}", sid=b"8"), id="another subscription"),
        pytest.param(frame(b"ev.Account.a", 6, 2, HEADERS, b"{}", ack_prefix=b"$JS.ACK.S.old."),
                     id="an earlier consumer"),
        pytest.param(frame(b"ev.Account.a", 6, 3, HEADERS, b"{}"), id="a gap in the consumer sequence"),
        pytest.param(b"HMSG _INBOX.x 7 32 32\r\nNATS/1.0 408 Request Timeout\r\n\r\n\r\n", id="a status message"),
        pytest.param(frame(b"ev.Account.a", 6, 2, HEADERS.replace(b"Es-Version: 1\r\n", b""), b"{}"),
                     id="a missing header"),
        pytest.param(frame(b"ev.Account.a", 6, 2, HEADERS.replace(b"Es-Type: Opened\r\n",
                                                                  b"Es-Type: Opened\r\nEs-Type: Again\r\n"), b"{}"),
                     id="a repeated header"),
        pytest.param(frame(b"other.Account.a", 6, 2, HEADERS, b"{}"), id="a subject under another prefix"),
        pytest.param(frame(b"ev.Account", 6, 2, HEADERS, b"{}"), id="a subject without entity"),
        pytest.param(frame(b"ev.Account.a.b", 6, 2, HEADERS, b"{}"), id="a subject with an extra token"),
        pytest.param(frame(b"ev.Account.a", 6, 2, HEADERS, b"{}")[:-5], id="an incomplete frame"),
        pytest.param(b"MSG ev.Account.a 7 2\r\n{}\r\n", id="a message without headers"),
        pytest.param(b"PING\r\n", id="a ping"),
    ],
)
def test_the_scanner_leaves_what_it_does_not_understand_to_python(odd: bytes) -> None:
    # One call stops right before the odd frame; the parser frames that one in Python, then scans on.
    end, run = _batches.Frames.scan(GOOD + odd + GOOD, 0, SID, ACK_PREFIX, (SUBJECT_PREFIX + ".").encode())
    assert end == len(GOOD) and run is not None and len(run) == 1


def test_malformed_frames_are_left_to_python_not_misread() -> None:
    # Declared lengths that do not end on the frame's CRLF: the scanner takes nothing.
    bad = GOOD.replace(b" %d %d\r\n" % (len(HEADERS), len(HEADERS) + 2), b" %d %d\r\n" % (len(HEADERS), len(HEADERS) + 1))
    assert scan_all(bad) == (0, [])
    # A body that holds what looks like a frame is still one body: lengths decide, not separators.
    body = b'{"x":1}\r\nHMSG ev.Account.b 7 r 1 1\r\n'
    tricky = frame(b"ev.Account.a", 5, 1, HEADERS, body)
    end, runs = scan_all(tricky)
    assert end == len(tricky) and len(runs) == 1
    payload = _batches.Converter(SUBJECT_PREFIX, ("payload",)).convert_frames(runs).column(0).to_pylist()
    assert payload == [body.decode()]


STATUS = b"HMSG _INBOX.x 7 32 32\r\nNATS/1.0 408 Request Timeout\r\n\r\n\r\n"


class Collected:
    """A bulk connection's receiver that keeps what it is given, in order (as the replay's does)."""

    def __init__(self, native: bool) -> None:
        prefix = (SUBJECT_PREFIX + ".").encode()
        self.scan = (lambda data, pos: _batches.Frames.scan(data, pos, SID, ACK_PREFIX, prefix)) if native else None
        self.parts: list[object] = []
        self.statuses: list[bytes] = []

    def add(self, rows: list[Raw]) -> None:
        self.statuses += [row[2] for row in rows if not row[1]]
        self.parts.append([row for row in rows if row[1]])

    def add_run(self, run: object) -> None:
        self.parts.append(run)

    def wake(self) -> None:
        pass

    def lost(self, error: Exception) -> None:
        raise AssertionError(error)


def parse_in_chunks(data: bytes, cuts: list[int], *, native: bool) -> list[tuple[int, str]]:
    """Feed ``data`` to a bulk connection in reads cut at ``cuts``; (position, payload) of what it routed."""
    conn = BulkConnection(ConnectionSecurity(), "test")
    conn._handshaking = False  # as after the handshake: the test feeds the connected protocol
    box = Collected(native)
    conn._subs[SID] = box
    bounds = [0, *sorted(set(cuts)), len(data)]
    for start, end in zip(bounds, bounds[1:]):
        conn.data_received(data[start:end])
    assert [s.split(b"\r\n")[0] for s in box.statuses] == [b"NATS/1.0 408 Request Timeout"]
    converter = _batches.Converter(SUBJECT_PREFIX, ("position", "payload"))
    routed = []
    for part in box.parts:
        if isinstance(part, _batches.Frames):
            batch = converter.convert_frames([part])
        else:
            assert isinstance(part, list)
            commits = Commits([int(row[1].split(b".")[-4]) for row in part], [row[0] for row in part],
                              [row[2] for row in part], [row[3] for row in part])
            batch = converter.convert(commits)
        routed += [(row["position"], row["payload"]) for row in batch.to_pylist()]
    return routed


@settings(max_examples=60, deadline=None)
@given(st.lists(commit_strategy, min_size=1, max_size=12), st.data(), st.booleans())
def test_the_parser_routes_every_message_once_however_the_reads_are_cut(
    commits: list[dict[str, object]], data: st.DataObject, native: bool
) -> None:
    stream, python = build(commits)
    # Another subscription's message and a status message in the middle, as the server interleaves them.
    middle = stream.find(b"HMSG", len(stream) // 2)
    middle = len(stream) if middle < 0 else middle
    other = b"MSG _INBOX.other 9 5\r\nhello\r\n"
    stream = stream[:middle] + other + STATUS + stream[middle:]
    cuts = data.draw(st.lists(st.integers(1, len(stream) - 1), max_size=8))
    whole = _batches.Converter(SUBJECT_PREFIX, ("position", "payload")).convert(python).to_pylist()
    expected = [(row["position"], row["payload"]) for row in whole]
    assert parse_in_chunks(stream, cuts, native=native) == expected


def test_a_control_line_of_another_layout_is_framed_in_python_and_the_reads_go_on() -> None:
    commits = [{"category": "Cart", "entity": f"c{i}", "events": [("Opened", 1, str(i))], "correlation": None,
                "causation": None, "msg_id": True} for i in range(3)]
    stream, python = build(commits)  # type: ignore[arg-type]
    first = stream.index(b"HMSG", 1)
    # A doubled space between the lengths (the server sends none): the native scanner leaves it to Python.
    odd = stream[:first].replace(b" %d %d\r\n" % (len(python.headers[0]), len(python.headers[0]) + len(python.bodies[0])),
                                 b" %d  %d\r\n" % (len(python.headers[0]), len(python.headers[0]) + len(python.bodies[0])))
    assert odd != stream[:first]
    for native in (True, False):
        routed = parse_in_chunks(odd + stream[first:] + STATUS, [], native=native)
        assert [position for position, _ in routed] == python.positions

"""The native accelerator (``eventstore/_native.c``): built, given its header names by ``wire``, equal to its
Python twins, and memory-safe under a sanitizer on bytes captured from a real server and mutated."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from eventstore import EventStore, EventStoreSettings, RecordedEvent, StreamId, TypeRegistry, encode_commit, native
from eventstore.jetstream import BulkConnection
from eventstore.wire import Header, decode_commit

from .events import Deposited

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(os.environ.get("NATIVE_SOURCE_UNDER_TEST", ROOT / "eventstore" / "_native.c"))


def test_the_native_accelerator_is_built_and_active() -> None:
    assert native.ACTIVE == "native", native.ACTIVE
    assert native.scan is not None


def test_the_scanner_takes_its_header_names_from_wire() -> None:
    from eventstore import _native

    assert _native.names() == tuple(name.encode() for name in native.SCANNED_HEADERS)
    assert native.SCANNED_HEADERS[:5] == (
        Header.TYPE, Header.SCHEMA_VERSION, Header.EVENT_ID, Header.VERSION, Header.RECORDED_AT
    )
    # No header name is typed again in C: a renamed header in wire.Header reaches the scanner.
    assert not re.search(r'"(Es|Nats)-', SOURCE.read_text())


def test_the_python_twins_run_without_the_accelerator_and_read_the_same(settings: EventStoreSettings) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, json
        from eventstore import EventStore, EventStoreSettings, native
        async def main():
            store = await EventStore.connect(EventStoreSettings.model_validate_json({settings.model_dump_json()!r}))
            events = [(e.position, e.type, e.payload.decode(), e.idempotency_key) async for b in store.read_all() for e in b]
            await store.close()
            print(json.dumps([native.ACTIVE, events]))
        asyncio.run(main())
        """
    )
    outputs = []
    for flag in ("0", "1"):
        env = {**os.environ, "JETSOURCING_NATIVE": flag, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        outputs.append(json.loads(done.stdout.splitlines()[-1]))
    (python_active, python_events), (native_active, native_events) = outputs
    assert python_active.startswith("python (JETSOURCING_NATIVE=0)") and native_active == "native"
    assert python_events == native_events and len(native_events) == 60  # 30 commits of 1 to 3 events


@pytest.fixture
async def settings(store: EventStore) -> EventStoreSettings:
    """A stream of 30 commits, some with several events, ids and an idempotency key."""
    store.registry.register(Deposited)
    for n in range(30):
        events = [Deposited(amount=n)] * (1 + n % 3)
        await store.append(StreamId("Account", f"a{n % 4}"), events, idempotency_key=f"k{n}",
                           correlation_id=f"c{n}" if n % 2 else None)
    return store.settings


async def capture(store: EventStore, path: Path) -> None:
    """Write the raw bytes a replay of ``store``'s stream receives, read by read, to ``path`` (JSON lines, hex)."""
    chunks: list[bytes] = []
    original = BulkConnection.data_received

    def recording(self: BulkConnection, data: bytes) -> None:
        chunks.append(bytes(data))
        original(self, data)

    BulkConnection.data_received = recording  # type: ignore[method-assign]
    try:
        assert sum([len(b) async for b in store.read_all()]) > 0
    finally:
        BulkConnection.data_received = original  # type: ignore[method-assign]
    path.write_text("\n".join(chunk.hex() for chunk in chunks))


FUZZ = """
import importlib.machinery, importlib.util, random, sys
loader = importlib.machinery.ExtensionFileLoader("_native", sys.argv[1])
native = importlib.util.module_from_spec(importlib.util.spec_from_loader("_native", loader))
loader.exec_module(native)
names = sys.argv[3].encode().split(b",")
native.headers(*names)
assert native.names() == tuple(names)
stream = b"".join(bytes.fromhex(line) for line in open(sys.argv[2]).read().split())
subject_prefix = sys.argv[4].encode()
rng = random.Random(12)
lines = [stream[i + 5:stream.index(b"\\r\\n", i)].split(b" ") for i in range(len(stream)) if stream.startswith(b"HMSG ", i)]
# (subscription id, the consumer's reply prefix "$JS.ACK.<stream>.<consumer>.") of the replay's messages
routes = {(line[1], b".".join(line[2].split(b".")[:4]) + b".") for line in lines if line[2].startswith(b"$JS.ACK.")}
def exercise(data):
    taken = 0
    for pos in range(len(data)):
        if data.startswith(b"HMSG", pos) or rng.random() < 0.02:
            for sid, ack in routes:
                end, count, *_ = native.scan(data, pos, sid, ack, subject_prefix)
                assert pos <= end <= len(data)
                taken += count
                native.events(data, pos, sid, ack, {}, None, None, None, None)
                native.events(data, pos, sid, ack, {}, bytes, None, tuple, None)
    for block in data.split(b"\\r\\n\\r\\n"):
        native.parse_headers(block + b"\\r\\n\\r\\n")
    return taken
assert exercise(stream) >= len(lines) > 0, "the scanner took none of the real frames"
for n in range(150):
    data = bytearray(stream[: rng.randrange(len(stream))] if n % 3 == 0 else stream)
    for _ in range(rng.randrange(1, 20)):
        i = rng.randrange(len(data))
        data[i] = rng.choice([0, 0x0D, 0x0A, 0x20, 0x2E, 0x3A, 0x80, 0xFF, rng.randrange(256)])
    exercise(bytes(data))
for n in range(2000):
    native.parse_headers(bytes(rng.randrange(256) for _ in range(rng.randrange(64))))
print("fuzzed")
"""


async def test_the_accelerator_is_memory_safe_on_real_and_mutated_bytes(
    settings: EventStoreSettings, store: EventStore, tmp_path: Path
) -> None:
    """Built with AddressSanitizer and UndefinedBehaviorSanitizer, fed a real replay's bytes and mutations of them."""
    await capture(store, tmp_path / "replay.hex")
    library = tmp_path / "_native.so"
    include = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    subprocess.run(
        ["gcc", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", str(library)],
        check=True, capture_output=True, timeout=120,
    )
    asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout
    # PYTHONMALLOC=malloc: every object its own allocation, so a read past a buffer hits a redzone.
    env = {**os.environ, "LD_PRELOAD": asan.strip(), "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "PYTHONMALLOC": "malloc",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    done = subprocess.run(
        [sys.executable, "-c", FUZZ, str(library), str(tmp_path / "replay.hex"),
         ",".join(native.SCANNED_HEADERS), settings.subject_prefix + "."],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0 and "fuzzed" in done.stdout, done.stderr[-3000:]
    assert "runtime error" not in done.stderr, done.stderr[-3000:]


_COMMIT = st.fixed_dictionaries(
    {
        "entity": st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=8),
        "types": st.lists(st.sampled_from(["Opened", "Deposited"]), min_size=1, max_size=3),
        "key": st.one_of(st.none(), st.text(max_size=8)),  # escaped when it needs to be: '%' takes the slow path
        "correlation": st.one_of(st.none(), st.text("abc123", min_size=1, max_size=8)),
        "batch": st.booleans(),
        # What a foreign writer might do to a value: nats-py strips it, so the native path must leave it to Python.
        "odd": st.sampled_from(["", " ", "\x0b", "\n"]),
    }
)


def _frames(commits: list[dict[str, object]]) -> tuple[bytes, list[tuple[bytes, dict[str, str], bytes, int]]]:
    stream, expected = b"", []
    for n, commit in enumerate(commits, 1):
        types = list(commit["types"])  # type: ignore[call-overload]
        headers, body = encode_commit(
            msg_id=f"m{n}", types=types, schema_versions=[1] * len(types), event_ids=[f"e{n}.{i}" for i in range(len(types))],
            payloads=[b'{"n":%d}' % n] * len(types), last_version=n + 5, recorded_at="2026-01-01T00:00:00+00:00",
            correlation_id=commit["correlation"], idempotency_key=commit["key"],  # type: ignore[arg-type]
        )
        if commit["batch"]:
            headers[Header.BATCH_ID] = "b1"
        headers[Header.VERSION] += str(commit["odd"])
        block = ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
        subject = StreamId("Account", str(commit["entity"])).subject("ev").encode()
        reply = b"$JS.ACK.S.C.1.%d.%d.0.0" % (n, n)
        stream += b"HMSG %s 7 %s %d %d\r\n%s%s\r\n" % (subject, reply, len(block), len(block) + len(body), block, body)
        expected.append((subject, native.parse_header_lines(block), body, n))
    return stream, expected


@hypothesis_settings(max_examples=150, deadline=None)
@given(st.lists(_COMMIT, min_size=1, max_size=6), st.sampled_from([None, frozenset({"Deposited"})]))
def test_native_events_equal_the_python_decoder(commits: list[dict[str, object]], handled: frozenset[str] | None) -> None:
    assert native.events is not None
    registry = TypeRegistry()
    stream, expected = _frames(commits)
    streams: dict[bytes, StreamId] = {}

    def make(subject: bytes) -> StreamId:
        streams[subject] = StreamId.from_subject(subject.decode(), "ev")
        return streams[subject]

    end, count, _, _, _, positions, subjects, headers, bodies, events = native.events(
        stream, 0, b"7", b"$JS.ACK.S.C.", streams, make, registry, lambda fields: tuple.__new__(RecordedEvent, fields),
        handled,
    )
    assert (end, count, positions) == (len(stream), len(commits), [e[3] for e in expected])

    def key(e: RecordedEvent) -> tuple[object, ...]:
        return (*e[:11], e.registry is registry, e.idempotency_key)

    for (subject, fields, body, seq), got_headers, event in zip(expected, headers, events):
        python = decode_commit(StreamId.from_subject(subject.decode(), "ev"), seq, fields, body, registry)
        wanted = [e for e in python if handled is None or e.type in handled]
        if event is not None:  # decoded natively: a plain commit of a wanted type
            assert got_headers is None and [key(event)] == [key(e) for e in wanted] and len(python) == 1
        elif got_headers is None:  # skipped natively: a plain commit of another type
            assert handled is not None and len(python) == 1 and not wanted
        else:  # left to Python, with the same headers nats-py would give
            assert got_headers == fields


def test_only_plain_commits_are_decoded_natively() -> None:
    assert native.events is not None
    plain = {"entity": "a", "types": ["Deposited"], "key": "k1", "correlation": "c", "batch": False, "odd": ""}
    others = [
        {**plain, "types": ["Opened", "Deposited"]},  # several events
        {**plain, "key": "50%"},  # an escaped idempotency key
        {**plain, "batch": True},  # a message of an atomic batch (the live hold-back reads its headers)
        {**plain, "odd": " "},  # whitespace nats-py would strip
    ]
    stream, _ = _frames([plain, *others])
    *_, headers, _, events = native.events(
        stream, 0, b"7", b"$JS.ACK.S.C.", {}, lambda s: StreamId.from_subject(s.decode(), "ev"), None,
        lambda fields: tuple.__new__(RecordedEvent, fields), None,
    )
    assert events[0] is not None and headers[0] is None and events[0].idempotency_key == "k1"
    assert all(e is None for e in events[1:]) and all(h is not None for h in headers[1:])

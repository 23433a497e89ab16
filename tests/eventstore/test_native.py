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

from eventstore import EventStore, EventStoreSettings, StreamId, native
from eventstore.jetstream import BulkConnection
from eventstore.wire import Header

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
subject_prefix, ack = sys.argv[4].encode(), b"$JS.ACK."
rng = random.Random(12)
sids = {stream[i + 5:].split(b" ")[1] for i in range(len(stream)) if stream.startswith(b"HMSG ", i)}
def exercise(data):
    for pos in range(0, len(data), max(1, len(data) // 200)):
        for sid in sids:
            end, count, *_ = native.scan(data, pos, sid, ack, subject_prefix)
            assert pos <= end <= len(data)
    for block in data.split(b"\\r\\n\\r\\n")[:50]:
        native.parse_headers(block + b"\\r\\n\\r\\n")
exercise(stream)
for n in range(300):
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

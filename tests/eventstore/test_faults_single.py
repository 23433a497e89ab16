"""Fault tests on one embedded nats-server: SIGKILL under load, a client killed mid-batch, readers beside atomic
batches, a full disk and JetStream's storage limit. The workload, its checker and the scenarios are in
``tests/support/workload.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from eventstore import (
    ANY,
    EmbeddedServer,
    EntityAppend,
    EventStore,
    EventStoreSettings,
    RecordedEvent,
    StorageError,
    StreamId,
    stop_task,
)
from projections import Daemon, Outcome, ProjectionSettings
from tests.conftest import unique_settings
from tests.support.workload import (
    CATEGORY,
    EXPECTED_ERRORS,
    Step,
    StepCounts,
    Workload,
    check,
    check_events,
    kill_clients,
    kill_server,
    projection_checkpoint,
    read_model_equals_rebuild,
)


def make_projection_settings(nats_url: str, database: Path) -> ProjectionSettings:
    """A stream, subject prefix and lease bucket of the test's own; timeouts short enough to see an outage."""
    tag = uuid.uuid4().hex[:10]
    return ProjectionSettings(
        eventstore=EventStoreSettings(nats_url=nats_url, stream=f"F{tag}", subject_prefix=f"f{tag}", request_timeout_s=1.0),
        database=database, lease_bucket=f"L{tag}", lease_ttl_s=2.0, status_interval_s=0.2, heartbeat_s=0.5,
    )


async def wait_for(condition: Callable[[], object], timeout_s: float, what: str | Callable[[], str]) -> None:
    """Poll ``condition`` every 20 ms until it is true; fail after ``timeout_s`` saying ``what`` (a callable: as it is then)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting until {what() if callable(what) else what}"
        await asyncio.sleep(0.02)


def _event(position: int, entity: str, version: int, command: str, part: int, parts: int, entities: list[str]) -> RecordedEvent:
    payload = json.dumps({"command": command, "part": part, "parts": parts, "entities": entities}).encode()
    return RecordedEvent(position, part, StreamId(CATEGORY, entity), version, "WorkStep", 1, f"id{position}-{part}",
                         payload, "2026-01-01T00:00:00+00:00")


def test_the_checker_finds_partial_commands_duplicates_and_gaps() -> None:
    whole = [_event(1, "a", 1, "c1", 0, 2, ["a"]), _event(1, "a", 2, "c1", 1, 2, ["a"])]
    report, stored = check_events(whole)
    assert (report.partial_commands, report.duplicated, report.gaps, stored) == (0, 0, 0, {"c1": {"a": (1, 2)}})

    half_batch = whole + [_event(2, "b", 1, "c2", 0, 1, ["b", "c"])]  # c2 also names entity c, which has nothing
    assert check_events(half_batch)[0].partial_commands == 1
    half_commit = whole + [_event(2, "b", 1, "c2", 0, 2, ["b"])]  # part 1 of 2 is missing
    assert check_events(half_commit)[0].partial_commands == 1
    twice = whole + [_event(3, "a", 3, "c1", 0, 2, ["a"]), _event(3, "a", 4, "c1", 1, 2, ["a"])]
    assert check_events(twice)[0].duplicated >= 2
    gap = whole + [_event(2, "a", 4, "c3", 0, 1, ["a"])]
    assert check_events(gap)[0].gaps == 1


async def test_sigkill_of_the_server_under_32_writers_loses_nothing_and_halves_nothing(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "nats").start()
    settings = make_projection_settings(server.url, tmp_path / "rm.sqlite3")
    daemon = Daemon([StepCounts()], settings)  # its own connection: it lives through the outage too
    following = asyncio.create_task(daemon.run())
    try:
        store = await EventStore.connect(settings.eventstore)
        workload = Workload(store, entities=500, writers=32, seed=11)
        try:
            workload.start()
            await asyncio.sleep(random.uniform(1.5, 2.5))  # the kill lands anywhere in a command
            assert len(workload.ledger.acked) > 20, workload.ledger.errors
            acked_before = len(workload.ledger.acked)
            outage = await kill_server(server, workload.ledger, down_s=2.0)
            killed, back = outage["killed"], outage["back"]
            failed_during_outage = sum(workload.ledger.errors.values())
            assert len(workload.ledger.acked) > acked_before
            acked_while_down = [a for a in workload.ledger.acked_at.values() if killed + 0.5 <= a < back]
            assert not acked_while_down, "acknowledged while the server was down"
            # Every kind of command goes through once the server is back, the command helper included.
            await wait_for(lambda: set(workload.ledger.acked_after(back)) == set(workload.kinds), 15, "writes resume")
            await asyncio.sleep(1.0)
        finally:
            await workload.stop()
            ledger = workload.ledger
        assert failed_during_outage > 0, "the writers saw no error while the server was down"
        report = await check(store, ledger)
        report.assert_clean()
        assert report.errors_by_type.get("ServerUnavailableError", 0) > 0
        for message in ledger.error_samples["ServerUnavailableError"]:
            assert f"{CATEGORY}/" in message, message  # names the entity the call was about
        assert report.unresolved == 0

        last = await store.last_position()
        await wait_for(lambda: projection_checkpoint(settings) == last, 30, "the daemon catches up")
        daemon.stop()
        assert await following == {StepCounts.name: Outcome.STOPPED}
        await read_model_equals_rebuild(settings, store, tmp_path / "clean.sqlite3")
        await store.close()
    finally:
        if not following.done():
            daemon.stop()
            await stop_task(following, timeout_s=10, grace_s=5)
        server.close()


async def test_a_client_killed_in_append_many_over_hundreds_of_entities_never_leaves_part_of_a_batch(
    store: EventStore, tmp_path: Path
) -> None:
    report = await kill_clients(store, tmp_path / "acked.txt", kills=5, entities=600, per_batch=(200, 400), seed=7)
    # Neither a reader running beside the batches nor the read after each kill saw part of a batch.
    assert (report.partial_commands, report.duplicated, report.gaps, report.lost) == (0, 0, 0, 0), report.problems[:5]
    assert report.reads > 0
    assert report.acked >= 10 and report.stored >= report.acked


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "16m") mounted at ``path`` for the test, unmounted after it (needs root, as in CI)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        if os.environ.get("CI"):
            raise AssertionError(f"cannot mount a tmpfs for the disk-full test: {mounted.stderr}")
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def fill(fd: int) -> None:
    """Write zeros to the open file ``fd`` until its disk is full (at once, if the disk already is)."""
    with contextlib.suppress(OSError):
        while True:
            os.write(fd, bytes(1 << 16))


def disk_usage(path: Path) -> str:
    usage = shutil.disk_usage(path)
    return f"{usage.used >> 10} KiB used of {usage.total >> 10} KiB"


STORAGE_ERRORS = EXPECTED_ERRORS | {"StorageError"}


async def test_a_full_disk_stops_appends_with_a_storage_error_and_a_restart_resumes_them(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "32m") as disk:
        server = EmbeddedServer(disk / "nats").start()
        # Opened before the writers start: creating a file on a disk that is already full fails, and how far the
        # writers get before the disk is filled depends on the machine's load.
        filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            settings = unique_settings(server.url, request_timeout_s=0.5, append_retries=1)
            store = await EventStore.connect(settings)
            workload = Workload(store, entities=100, writers=8, seed=3, max_backoff_s=0.2)
            try:
                workload.start()
                await wait_for(lambda: len(workload.ledger.acked) > 50, 10, "the writers append")
                fill(filler)
                await wait_for(lambda: workload.ledger.errors["StorageError"] >= 3, 20,
                               lambda: f"writers see StorageError (acked {len(workload.ledger.acked)}, errors "
                                       f"{dict(workload.ledger.errors)}, {disk_usage(disk)})")
                # Space coming back is not enough: nats-server stores nothing more on a stream whose storage
                # failed a write until it restarts. (A read-only remount is refused while the server has files
                # open for writing, so a full disk is the write failure tested here.)
                os.close(filler)
                filler = -1
                (disk / "filler").unlink()
                server.stop()
                server.start()
                back = time.monotonic()
                await wait_for(lambda: set(workload.ledger.acked_after(back)) == set(workload.kinds), 20,
                               lambda: f"appends resume after the restart ({disk_usage(disk)})")
            finally:
                await workload.stop()
            report = await check(store, workload.ledger)
            report.assert_clean(expected_errors=STORAGE_ERRORS)
            message = workload.ledger.error_samples["StorageError"][0]
            assert "disk is full or read-only" in message and "restart" in message, message
            await store.close()
        finally:
            if filler >= 0:  # the test failed before it was closed
                os.close(filler)
            server.close()


async def test_the_servers_storage_limit_refuses_appends_with_a_storage_error(tmp_path: Path) -> None:
    # JetStream's limit (max_file_store) defaults to 75% of the disk's free space when the server starts.
    with small_disk(tmp_path / "disk", "4m") as disk:
        server = EmbeddedServer(disk / "nats").start()
        try:
            store = await EventStore.connect(unique_settings(server.url))
            store.registry.register(Step)
            entity = StreamId(CATEGORY, "big")
            acked = 0
            with pytest.raises(StorageError) as refused:
                for n in range(10_000):
                    events = [Step(command=f"c{n}", part=0, parts=1, entities=["x" * 4000])]
                    await store.append(entity, events, idempotency_key=f"c{n}")
                    acked += 1
            message = str(refused.value)
            assert "storage limit is reached" in message and "Nothing was stored" in message, message
            assert "max_file_store" in message
            assert acked > 100
            # More room, and a restart (the limit is computed at start): writing resumes; nothing was lost.
            remount(disk, "size=64m")
            server.stop()
            server.start()
            await store.append(entity, [Step(command="after", part=0, parts=1, entities=["x"])], idempotency_key="after")
            versions = [e.version for e in await store.read(entity)]
            assert versions == list(range(1, acked + 2))
            await store.close()
        finally:
            server.close()


async def test_a_live_subscriber_never_sees_part_of_an_atomic_batch(store: EventStore) -> None:
    # The server applies a batch one message at a time and a consumer can deliver the part applied so far.
    store.registry.register(Step)
    commands, entities = 20, 150
    ids = [f"e{i:03d}" for i in range(entities)]

    def append_many(n: int) -> Awaitable[object]:
        step = Step(command=f"c{n}", part=0, parts=1, entities=ids)
        requests = [EntityAppend(StreamId(CATEGORY, e), [step], ANY) for e in ids]
        # The batch's commit (its last message) is on another category: a filtered subscriber never sees it.
        return store.append_many([*requests, EntityAppend(StreamId("Other", "x"), [step], ANY)])

    async def follow(categories: list[str] | None, per_command: int) -> int:
        seen: Counter[str] = Counter()
        yields = 0
        async for batch in store.subscribe(categories=categories, heartbeat_s=0.2):
            yields += 1
            seen.update(json.loads(e.payload)["command"] for e in batch)
            partial = {c: n for c, n in seen.items() if n != per_command}
            assert not partial, f"after yield {yields} (categories {categories}): {partial} of {per_command}"
            if len(seen) == commands:
                return yields
        raise AssertionError("unreachable")

    async with asyncio.timeout(60):
        followers = [asyncio.create_task(follow(None, entities + 1)), asyncio.create_task(follow([CATEGORY], entities))]
        for n in range(commands):
            await append_many(n)
        assert all(yields > 0 for yields in await asyncio.gather(*followers))

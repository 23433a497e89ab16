"""The Spark follower under the outage policy: a NATS outage is waited out (for ever by default, as the daemon
does), each event still reaches Delta once, a stop is never held up, and giving up at ``outage_limit_s`` ends
``jetsourcing spark follow`` with one line that names the server.

Each test runs its own nats-server (stopped and started again on the same port and storage), never the
session's. Real Spark, real Delta (read back with delta-rs), a real nats-server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from eventstore import EmbeddedServer, EventStore, EventStoreSettings
from spark_projections._options import Options
from spark_projections._range_reader import range_parts
from spark_projections.errors import EventSourceError
from spark_projections.follow import batch_end, follow, follow_status
from spark_projections.projection import rebuild

from test_follow import checkpoint_batches, delta_rs_rows, follow_command, wait_for
from test_projection import history, history_positions, shipped  # noqa: F401 - executors import the examples
from projection_examples import AccountBalances, Movements, append_workload, register_all, workload

OUTAGE_S = 60.0  # twice the 30 s after which the follower gave up before the outage policy


async def append(settings: EventStoreSettings, count: int, seed: int) -> int:
    """Append ``count`` account commits (and some of another category); the stream's last position."""
    async with EventStore.connect(settings) as store:
        return await history(store, workload(count, 12, seed=seed))


def assert_caught_up_once(spark: SparkSession, projection: Movements, settings: EventStoreSettings, root: Path,
                          rebuilt: Path, last: int) -> None:
    """The next run catches up to ``last``, and the followed tables equal a rebuild's, each range committed once."""
    assert follow(spark, projection, settings, root, available_now=True).await_termination(240)
    assert rebuild(spark, projection, settings, rebuilt).position == last
    assert delta_rs_rows(root, projection) == delta_rs_rows(rebuilt, projection)
    positions = [p for _, p in history_positions(root / "movements")]
    assert positions == sorted(set(positions)) and positions[-1] == last


def read_positions(opts: Options, last: int, server: EmbeddedServer, outage_s: float) -> list[int]:
    """Read positions 1..last as a partition does, stopping the server for ``outage_s`` after the first batch."""
    parts = range_parts(opts, 1, last, outage_limit_s=None)
    seen = [p for part in next(parts) for p in part.position_list()]
    failed: list[BaseException] = []

    def read_the_rest() -> None:
        try:
            seen.extend(p for batch in parts for part in batch for p in part.position_list())
        except BaseException as exc:
            failed.append(exc)

    server.stop()
    reader = threading.Thread(target=read_the_rest)
    reader.start()
    time.sleep(outage_s)
    server.start()  # from this thread: the server dies with the thread that started it
    reader.join(60)
    assert not reader.is_alive() and not failed, failed
    return seen


def test_a_partition_read_waits_out_an_outage_logged_by_state_and_hands_over_each_event_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = EmbeddedServer(tmp_path / "js").start()
    try:
        settings = EventStoreSettings(nats_url=server.url)

        async def fill() -> int:
            async with EventStore.connect(settings) as store:
                register_all(store)
                await append_workload(store, workload(400, 10, seed=31))
                return await store.last_position()

        last = asyncio.run(fill())
        # Small pull requests: the outage starts with most of the range still on the server.
        opts = Options.parse({"url": server.url, "batch": "40", "request_timeout_s": "1"})
        with caplog.at_level(logging.INFO, logger="spark_projections.source"):
            seen = read_positions(opts, last, server, outage_s=5.0)
    finally:
        server.stop()
    assert seen == list(range(1, last + 1))  # each once, in order, across the outage
    lines = [r.getMessage() for r in caplog.records if r.name == "spark_projections.source"]
    assert len(lines) == 2, lines  # one line when the outage starts, one when it ends: not one per attempt
    assert f"Reading positions 1..{last}" in lines[0] and "failed (Could not connect to NATS at" in lines[0], lines
    assert "retrying" in lines[0] and "works again" in lines[1], lines


def test_a_partition_read_gives_up_at_the_outage_limit_naming_the_server(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "js").start()
    url = server.url
    server.stop()
    opts = Options.parse({"url": url, "request_timeout_s": "0.5"})
    started = time.monotonic()
    with pytest.raises(EventSourceError) as failure:
        list(range_parts(opts, 1, 10, outage_limit_s=1.0))
    assert time.monotonic() - started < 10
    message = str(failure.value)
    assert message.startswith(f"Could not connect to NATS at {url} within 0.5s"), message
    assert "the outage reached its limit of 1s (outage_limit_s, JETSOURCING_OUTAGE_LIMIT_S)" in message, message


async def test_a_follower_waits_out_an_outage_longer_than_the_old_give_up_and_delivers_each_event_once(
    spark: SparkSession, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The server stops while the follower catches up and stays down for a minute, twice the 30 s after which
    the follower used to give up; started again, it has the follower go on. Then the server stops with a
    micro-batch in flight and the follower is stopped: within seconds, cleanly; the next run does that batch
    again. Each event reaches Delta once."""
    server = EmbeddedServer(tmp_path / "js").start()
    try:
        settings = EventStoreSettings(nats_url=server.url)  # outage_limit_s: None, wait for ever
        await append(settings, 120, seed=32)
        projection = Movements()
        root = tmp_path / "followed"
        checkpoint = root / "_jetsourcing" / "checkpoints" / "movements.v1"
        follower = follow(spark, projection, settings, root, trigger_s=0.3, max_events_per_trigger=60)
        try:
            wait_for(lambda: follower.status is not None, 240, "the first micro-batch")
            server.stop()  # a micro-batch is most likely in flight: its reads wait the outage out
            down = time.monotonic()
            while time.monotonic() - down < OUTAGE_S:
                assert follower.active, f"the follower gave up during the outage: {follower.query.exception()}"
                await asyncio.sleep(0.5)
            server.start()
            first = await append(settings, 30, seed=33)
            wait_for(lambda: follower.status is not None and follower.status.position == first or not follower.active,
                     240, "the follower to read the events appended after the outage")
            assert follower.active and follower.query.exception() is None, follower.query.exception()

            last = await append(settings, 300, seed=35)
            wait_for(lambda: (lambda o, c: o > c)(*checkpoint_batches(checkpoint)), 60, "a micro-batch in flight")
            server.stop()  # another outage, a micro-batch in flight: stopping the follower must not wait for it
            await asyncio.sleep(1.0)
            stopping = time.monotonic()
            follower.stop(grace_s=1.0)
            assert time.monotonic() - stopping < 15
            assert not follower.active and follower.query.exception() is None
        finally:
            if follower.active:
                follower.query.stop()
        server.start()
        assert_caught_up_once(spark, projection, settings, root, tmp_path / "rebuilt", last)
    finally:
        server.stop()
    # A stop that cut a micro-batch short used to kill Spark's thread with a StackOverflowError (thousands of lines).
    assert "StackOverflowError" not in capfd.readouterr().err


async def test_a_follower_past_the_outage_limit_fails_naming_the_server_and_its_batch_is_redone_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The server stops with a micro-batch in flight and stays down past ``outage_limit_s``: the query fails,
    :attr:`Follower.failure` names the server and the limit (not "An error occurred while calling
    o123.localCheckpoint"), nothing of the batch was written, and the next run does it exactly once."""
    server = EmbeddedServer(tmp_path / "js").start()
    try:
        settings = EventStoreSettings(nats_url=server.url, outage_limit_s=2)
        await append(settings, 150, seed=36)
        projection = Movements()
        root = tmp_path / "limited"
        checkpoint = root / "_jetsourcing" / "checkpoints" / "movements.v1"
        follower = follow(spark, projection, settings, root, trigger_s=0.3, max_events_per_trigger=100)
        try:
            wait_for(lambda: follower.status is not None, 240, "the first micro-batch")
            last = await append(settings, 300, seed=37)
            wait_for(lambda: (lambda o, c: o > c)(*checkpoint_batches(checkpoint)), 60, "a micro-batch in flight")
            server.stop()
            wait_for(lambda: not follower.active, 120, "the follower to give up")
        finally:
            if follower.active:
                follower.query.stop()
        failure = follower.failure or ""
        assert failure.startswith(f"Could not connect to NATS at {server.url} within 5.0s"), failure
        assert "the outage reached its limit of 2s (outage_limit_s, JETSOURCING_OUTAGE_LIMIT_S)" in failure, failure
        planned, finished = checkpoint_batches(checkpoint)
        assert planned in (finished, finished + 1)
        # Nothing of the batch that failed was written: the tables are at most where the last finished batch ended.
        assert history_positions(root / "movements")[-1][1] <= batch_end(checkpoint, finished - 1)
        server.start()
        assert_caught_up_once(spark, projection, settings, root, tmp_path / "rebuilt", last)
    finally:
        server.stop()


async def test_the_follow_command_at_the_outage_limit_ends_with_one_line_naming_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = EmbeddedServer(tmp_path / "js").start()
    try:
        settings = EventStoreSettings(nats_url=server.url)
        last = await append(settings, 100, seed=34)
        root = tmp_path / "limited"
        monkeypatch.setenv("JETSOURCING_OUTAGE_LIMIT_S", "3")  # the follow command's environment
        process = follow_command(settings, root, "--trigger-s", "0.3")
        try:
            checkpoint = root / "_jetsourcing" / "checkpoints" / "account_balances.v1"
            projection = AccountBalances()

            def caught_up() -> bool:
                status = follow_status(root, projection)
                return status is not None and status.position == last and len(set(checkpoint_batches(checkpoint))) == 1

            # Idle, caught up: the outage meets the planning of the next micro-batch.
            wait_for(caught_up, 300, "the follower to catch up", process)
            server.stop()
            out, _ = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    finally:
        server.stop()
    assert process.returncode == 1, out  # a failure it explains
    final = out.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"jetsourcing: the streaming query failed: Could not connect to NATS at {re.escape(server.url)} within "
        r"5\.0s \(.*\)\. Check that the server is up and reachable; the outage reached its limit of 3s "
        r"\(outage_limit_s, JETSOURCING_OUTAGE_LIMIT_S\)\. Start the servers, or raise the limit \(unset, it waits "
        r"for ever\)\.", final), out
    # The outage was logged when it started and when the follower gave up; no stack trace anywhere.
    assert len(re.findall(r"WARNING Planning a micro-batch of stream .* failed \(Could not connect", out)) == 1, out
    assert len(re.findall(r"ERROR Planning a micro-batch .* the outage limit \(outage_limit_s\); giving up", out)) == 1
    for trace in ("Traceback", "\tat ", "py4j", "Exception:", "SQLSTATE"):
        assert trace not in out, out

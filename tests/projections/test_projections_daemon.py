"""The daemon: live following, burst mode from the CLI, clean stop on SIGTERM, error policies, status, leases."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from eventstore import EmbeddedServer, EventStore, RecordedEvent, StreamId
from projections import (
    Daemon,
    ErrorPolicy,
    Outcome,
    ProjectionSettings,
    Reactor,
    open_store,
    read_status,
    run_reactor,
)

from projection_examples import (
    ACCOUNT,
    AccountBalances,
    AccountOpened,
    Corrupted,
    Deposited,
    FragileBalances,
    Movements,
    append_workload,
    register_all,
    workload,
)
from projection_helpers import (
    ROOT,
    both_stores,
    burst,
    checkpoint,
    cli,
    cli_env,
    dump,
    make_settings,
    memory_fold,
    spawn,
    wait_until,
)


async def test_live_following_applies_each_append_within_milliseconds(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(500, accounts=50))
    daemon = Daemon([AccountBalances()], psettings, event_store=es)
    task = asyncio.create_task(daemon.run())
    await wait_until(lambda: checkpoint(psettings, "account_balances") >= 1, what="catch-up")
    reader = sqlite3.connect(psettings.database)
    account = StreamId(ACCOUNT, "live-1")
    await es.append(account, [AccountOpened(owner="live")])
    latencies = []
    try:
        for i in range(1, 101):
            started = time.perf_counter()
            await es.append(account, [Deposited(amount=1)])
            while True:
                row = reader.execute("SELECT deposits FROM balances WHERE account_id = 'live-1'").fetchone()
                if row and row[0] == i:
                    break
                await asyncio.sleep(0.0005)
            latencies.append(time.perf_counter() - started)
    finally:
        reader.close()
        daemon.stop()
        assert await task == {"account_balances": Outcome.STOPPED}
    latencies.sort()
    p99 = latencies[98]
    print(f"live latency p50 {statistics.median(latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    assert p99 < 1.0  # the benchmark holds the real target (< 100 ms); this only catches gross regressions on a busy CI box
    assert dump(psettings, "account_balances") == await memory_fold(AccountBalances(), es)


@both_stores
async def test_cli_burst_mode_exits_zero_when_caught_up(es: EventStore, psettings: ProjectionSettings) -> None:
    await append_workload(es, workload(800, accounts=80))
    proc = await asyncio.to_thread(
        subprocess.run,
        cli("run", "projection_examples:AccountBalances", "projection_examples:Movements", "--until-caught-up"),
        env=cli_env(psettings), cwd=Path(__file__).parent.parent.parent, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "caught up to position" in proc.stderr
    assert "events applied" in proc.stderr  # counters logged on shutdown
    assert dump(psettings, "account_balances") == await memory_fold(AccountBalances(), es)
    assert dump(psettings, "movements") == await memory_fold(Movements(), es)
    assert checkpoint(psettings, "movements") == await es.last_position()


@both_stores
async def test_sigterm_finishes_the_batch_commits_and_logs_counters(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(2000, accounts=100))
    proc = spawn(psettings, "run", "projection_examples:AccountBalances", stderr=subprocess.PIPE)
    try:
        last = await es.last_position()
        await wait_until(lambda: checkpoint(psettings, "account_balances") == last, 30, "the daemon to catch up")
        statuses = await read_status(psettings, event_store=es)
        assert statuses[0].state == "running" and statuses[0].lag_commits == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    assert proc.returncode == 0, stderr.decode()
    text = stderr.decode()
    assert "Received SIGTERM" in text and f"checkpoint {last}" in text and "events applied" in text
    [status] = await read_status(psettings, event_store=es)
    assert status.state == "stopped" and status.counters["checkpoint"] == last


@both_stores
async def test_stop_policy_stops_only_the_failing_projection_with_a_full_report(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(300, accounts=30))
    poison = await es.append(StreamId(ACCOUNT, "acc-00001"), [Corrupted(detail="bad data")])
    await append_workload(es, workload(300, accounts=30, seed=99))
    outcomes = await Daemon([FragileBalances(), Movements()], psettings, event_store=es).run(until_caught_up=True)
    assert outcomes == {"fragile_balances": Outcome.ERROR, "movements": Outcome.CAUGHT_UP}
    assert checkpoint(psettings, "fragile_balances") == poison.position - 1
    assert checkpoint(psettings, "movements") == await es.last_position()

    statuses = {s.projection: s for s in await read_status(psettings, event_store=es)}
    fragile = statuses["fragile_balances"]
    assert fragile.state == "error"
    assert fragile.error is not None
    assert fragile.error["position"] == poison.position
    assert fragile.error["event_type"] == "Corrupted"
    assert fragile.error["stream_id"] == "Account/acc-00001"
    assert "ValueError: cannot apply" in fragile.error["traceback"]
    assert fragile.lag_commits == await es.last_position() - poison.position + 1
    # The model holds exactly the commits before the poison event (the poison handler's write was rolled back).
    rows = dump(psettings, "fragile_balances")["balances"]
    assert all(r["owner"] != "poison" for r in rows)
    assert max(r["last_position"] for r in rows) < poison.position

    # Restarting does not skip it silently: it stops at the same place again.
    outcomes = await Daemon([FragileBalances()], psettings, event_store=es).run(until_caught_up=True)
    assert outcomes == {"fragile_balances": Outcome.ERROR}
    assert checkpoint(psettings, "fragile_balances") == poison.position - 1


@both_stores
async def test_dead_letter_policy_skips_whole_commits_and_records_them(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    account = StreamId(ACCOUNT, "dl-1")
    await es.append(account, [AccountOpened(owner="o")])
    await es.append(account, [Deposited(amount=10)])
    bad = await es.append(account, [Deposited(amount=1000), Corrupted(detail="x"), Deposited(amount=1000)])
    await es.append(account, [Deposited(amount=5)])
    lone_bad = await es.append(StreamId(ACCOUNT, "dl-2"), [Corrupted(detail="y")])
    settings = psettings.model_copy(update={"error_policy": ErrorPolicy.DEAD_LETTER})
    await burst([FragileBalances()], settings, es)
    [row] = [r for r in dump(settings, "fragile_balances")["balances"] if r["account_id"] == "dl-1"]
    assert row["balance"] == 15  # the whole three-event commit was skipped, not just the failing event
    assert checkpoint(settings, "fragile_balances") == lone_bad.position
    with contextlib.closing(open_store(settings)) as store:
        letters = store.dead_letters("fragile_balances")
    assert [(d.position, d.index, d.event_type, d.stream_id) for d in letters] == [
        (bad.position, 1, "Corrupted", "Account/dl-1"),
        (lone_bad.position, 0, "Corrupted", "Account/dl-2"),
    ]
    assert "ValueError" in letters[0].traceback
    [status] = await read_status(settings, event_store=es)
    assert status.dead_letters == 2 and status.state == "stopped"


@both_stores
async def test_status_cli_reports_checkpoint_lag_and_state(es: EventStore, psettings: ProjectionSettings) -> None:
    await append_workload(es, workload(200, accounts=20))
    await burst([AccountBalances(), Movements()], psettings, es)
    await append_workload(es, workload(5, accounts=3, seed=5))
    await asyncio.sleep(0.05)
    env = cli_env(psettings)
    root = Path(__file__).parent.parent.parent
    text = await asyncio.to_thread(
        subprocess.run, cli("status"), env=env, cwd=root, capture_output=True, text=True, timeout=30
    )
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split()[:3] == ["projection", "state", "version"]
    balances_line = next(line for line in lines if line.startswith("account_balances"))
    assert balances_line.split()[1] == "stopped"
    as_json = await asyncio.to_thread(
        subprocess.run, cli("status", "--json"), env=env, cwd=root, capture_output=True, text=True, timeout=30
    )
    answer = json.loads(as_json.stdout)
    assert answer["reactors"] == []  # the server was asked: this stream has no reactors
    statuses = {s["projection"]: s for s in answer["projections"]}
    last = await es.last_position()
    for name in ("account_balances", "movements"):
        assert statuses[name]["last_position"] == last
        assert statuses[name]["checkpoint"] == last - 5
        assert statuses[name]["lag_commits"] == 5
        assert 0 < statuses[name]["lag_s"] < 30
        assert statuses[name]["state"] == "stopped"


@both_stores
async def test_second_daemon_waits_and_takes_over_when_the_first_dies(
    es: EventStore, psettings: ProjectionSettings, tmp_path: Path
) -> None:
    await append_workload(es, workload(500, accounts=50))
    logs = [open(tmp_path / f"daemon{i}.log", "w+b") for i in range(2)]
    procs = [spawn(psettings, "run", "projection_examples:AccountBalances", stderr=log) for log in logs]
    try:
        last = await es.last_position()
        await wait_until(lambda: checkpoint(psettings, "account_balances") == last, 30, "catch-up")
        [status] = await read_status(psettings, event_store=es)
        owner_pid = int(status.owner.split(":")[1])  # type: ignore[union-attr]
        first = next(p for p in procs if p.pid == owner_pid)
        second = next(p for p in procs if p.pid != owner_pid)
        second_log = logs[procs.index(second)]
        await wait_until(lambda: b"waiting to take over" in (second_log.seek(0) or second_log.read()), 30,
                         "the second daemon to wait")
        assert b"owning generation" not in (second_log.seek(0) or second_log.read())

        first.kill()  # SIGKILL: no lease release, the TTL (2 s) has to expire
        first.wait()
        await append_workload(es, workload(200, accounts=50, seed=3))
        last = await es.last_position()
        await wait_until(lambda: checkpoint(psettings, "account_balances") == last, 30, "the takeover")
        [status] = await read_status(psettings, event_store=es)
        assert status.owner is not None and int(status.owner.split(":")[1]) == second.pid
        assert status.state == "running"
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            await asyncio.to_thread(p.wait, 30)
        for log in logs:
            log.close()
    assert dump(psettings, "account_balances") == await memory_fold(AccountBalances(), es)


async def test_status_watch_shows_projections_and_reactors_live_until_ctrl_c(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(200, accounts=20))
    await burst([AccountBalances()], psettings, es)

    async def ignore(event: RecordedEvent) -> None:
        pass

    async with asyncio.timeout(15):
        await run_reactor(es, Reactor("mailer", handler=ignore), until_idle=True)
    text = await asyncio.to_thread(
        subprocess.run, cli("status"), env=cli_env(psettings), cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert text.returncode == 0, text.stderr
    reactor_lines = text.stdout[text.stdout.index("\nreactor"):].split("\n")
    assert reactor_lines[2].split() == ["mailer", "0", "0", "0", "0"], text.stdout
    proc = await asyncio.create_subprocess_exec(
        *cli("status", "--watch", "0.2"), cwd=ROOT,
        env={**cli_env(psettings), "COLUMNS": "100", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"},  # a terminal's
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    screen = ""
    try:
        async with asyncio.timeout(60):  # Ctrl-C once the screen is up (not during a slow start's imports)
            while "Ctrl-C ends" not in screen:
                chunk = await proc.stdout.read(4096)
                assert chunk, f"the watch ended before its first screen: {screen}"
                screen += chunk.decode()
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(15):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 130, err.decode()
    screen += out.decode()
    assert "account_balances" in screen and "mailer" in screen and "Ctrl-C ends" in screen, screen


async def test_ctrl_c_stops_the_daemon_cleanly_and_exits_130(es: EventStore, psettings: ProjectionSettings) -> None:
    await append_workload(es, workload(300, accounts=30))
    proc = spawn(psettings, "run", "projection_examples:AccountBalances", stderr=subprocess.PIPE)
    try:
        last = await es.last_position()
        await wait_until(lambda: checkpoint(psettings, "account_balances") == last, 30, "the daemon to catch up")
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    assert proc.returncode == 130, stderr.decode()
    assert "Received SIGINT" in stderr.decode()
    [status] = await read_status(psettings, event_store=es)
    assert status.state == "stopped" and status.checkpoint == last


async def test_a_nats_outage_past_the_outage_limit_stops_the_daemon_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """outage_limit_s: a daemon whose server stays away past it stops (ERROR) and says why in one line."""
    server = EmbeddedServer(tmp_path / "nats")
    server.start()
    settings = make_settings(server.url, tmp_path / "views.sqlite3")
    settings = settings.model_copy(update={"eventstore": settings.eventstore.model_copy(
        update={"outage_limit_s": 1.5, "request_timeout_s": 1.0})})
    es = await EventStore.connect(settings.eventstore)
    register_all(es)
    try:
        await append_workload(es, workload(50, accounts=5))
        daemon = Daemon([AccountBalances()], settings, event_store=es)
        running = asyncio.create_task(daemon.run())
        last = await es.last_position()
        await wait_until(lambda: checkpoint(settings, "account_balances") == last, 30, "catch-up")
        server.stop()
        stopped = time.monotonic()
        async with asyncio.timeout(30):
            outcomes = await running
        assert outcomes == {"account_balances": Outcome.ERROR}
        assert time.monotonic() - stopped < 20
        [line] = [r for r in caplog.records if "account_balances: stopped" in r.getMessage()]
        assert r"nats://127.0.0.1" in line.getMessage() and line.exc_info is None
    finally:
        await es.close()
        server.close()

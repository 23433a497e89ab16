"""Rebuild by replay into a shadow generation, switched atomically; version bumps; failed and killed rebuilds."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from pathlib import Path

import pytest

from eventstore import EmbeddedServer, EventStore, StreamId
from projections import Daemon, Outcome, ProjectionSettings, RebuildError, Table, open_store, read_status, rebuild
from projections.projection import handles

from projection_examples import (
    ACCOUNT,
    AccountBalances,
    AccountBalancesV2,
    Deposited,
    RecordedEvent,
    SlowBalances,
    Transaction,
    append_workload,
    register_all,
    workload,
)
from projection_helpers import (
    both_stores,
    burst,
    checkpoint,
    clean_rebuild,
    count_rows,
    dump,
    make_settings,
    memory_fold,
    spawn,
    tables_in,
    wait_until,
)


def generation_tables(settings: ProjectionSettings) -> set[str]:
    """The generation tables (``<table>__g<n>``) in the read-model database."""
    return {t for t in tables_in(settings) if "__g" in t}


def building(psettings: ProjectionSettings) -> int:
    """The checkpoint of the generation a rebuild is filling (0 when there is none)."""
    with contextlib.closing(open_store(psettings)) as store:
        [s] = store.statuses()
        return s.building.checkpoint if s.building else 0


@both_stores
async def test_rebuild_while_writers_append_switches_to_a_caught_up_model(
    es: EventStore, psettings: ProjectionSettings, tmp_path: Path
) -> None:
    await append_workload(es, workload(6000, accounts=600))
    daemon = Daemon([AccountBalances()], psettings, event_store=es)
    running = asyncio.create_task(daemon.run())
    last = await es.last_position()
    await wait_until(lambda: checkpoint(psettings, "account_balances") == last, 30, "catch-up")

    writing = asyncio.create_task(append_workload(es, workload(3000, accounts=900, seed=11), concurrency=4))
    log = open(tmp_path / "rebuild.log", "w+b")
    proc = spawn(psettings, "rebuild", "projection_examples:AccountBalances", "--batch-size", "500", stderr=log)
    # While the rebuild runs, readers keep querying the live model, which keeps moving.
    seen = []
    while proc.poll() is None:
        seen.append((count_rows(psettings), checkpoint(psettings, "account_balances")))
        await asyncio.sleep(0.05)
    log.seek(0)
    output = log.read().decode()
    assert proc.returncode == 0, output
    assert "replaying positions" in output and "(finished)" in output and "events/s" in output  # progress as log lines
    assert len({cp for _, cp in seen}) > 1, "the live model was not updated during the rebuild"

    await writing
    # Events after the switch: the daemon must apply them to generation 2 (if the writers
    # finished before the switch, this is what makes it notice).
    await append_workload(es, workload(20, accounts=900, seed=12))
    last = await es.last_position()
    await wait_until(lambda: checkpoint(psettings, "account_balances") == last, 30, "the daemon to follow gen 2")
    daemon.stop()
    assert await running == {"account_balances": Outcome.STOPPED}

    [status] = await read_status(psettings, event_store=es)
    assert status.generation == 2 and status.rebuild is None
    assert status.counters["conflicts"] >= 1  # the daemon noticed the switch and reloaded
    assert not any(t.endswith("__g1") for t in tables_in(psettings))  # old generation dropped
    assert dump(psettings, "account_balances") == await clean_rebuild(AccountBalances(), psettings, es, tmp_path)


@both_stores
async def test_failed_rebuild_leaves_the_old_model_in_place(es: EventStore, psettings: ProjectionSettings) -> None:
    await append_workload(es, workload(1000, accounts=100))
    await burst([AccountBalances()], psettings, es)
    before = dump(psettings, "account_balances")
    failing_at = (await es.last_position()) // 2

    class Broken(AccountBalancesV2):
        @handles(Deposited)
        def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
            if event.position >= failing_at:
                raise RuntimeError("bug in the new version")
            super().deposited(event, tx)

    with pytest.raises(RebuildError, match="bug in the new version"):
        await rebuild(Broken(), psettings, event_store=es)
    assert dump(psettings, "account_balances") == before
    assert not any(t.endswith("__g2") for t in tables_in(psettings))
    [status] = await read_status(psettings, event_store=es)
    assert status.generation == 1 and status.version == 1 and status.rebuild is None


@both_stores
async def test_killed_rebuild_leaves_the_old_model_and_the_next_rebuild_succeeds(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(1500, accounts=100))
    await burst([AccountBalances()], psettings, es)
    before = dump(psettings, "account_balances")
    proc = spawn(psettings, "rebuild", "projection_examples:SlowBalances", "--batch-size", "50",
                 stderr=subprocess.DEVNULL)

    await wait_until(lambda: building(psettings) > 0, 20, "the rebuild to make progress")
    [status] = await read_status(psettings, event_store=es)
    assert status.state == "rebuilding" and status.rebuild is not None and status.rebuild.active
    proc.kill()
    proc.wait()
    assert dump(psettings, "account_balances") == before
    await wait_until(lambda: building(psettings) > 0, 1, "the abandoned generation to still be there")
    await asyncio.sleep(psettings.stale_after_s)
    [status] = await read_status(psettings, event_store=es)
    assert status.rebuild is not None and not status.rebuild.active and status.state == "stopped"

    result = await rebuild(AccountBalancesV2(), psettings, event_store=es)
    assert result.generation == 3
    assert dump(psettings, "account_balances") == await memory_fold(AccountBalancesV2(), es)
    assert generation_tables(psettings) == {"balances__g3", "closures__g3"}


async def test_version_bump_rebuilds_on_start_and_other_mismatches_are_refused(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(800, accounts=80))
    await burst([AccountBalances()], psettings, es)
    assert dump(psettings, "account_balances") != await memory_fold(AccountBalancesV2(), es)

    await burst([AccountBalancesV2()], psettings, es)  # auto_rebuild: replays into generation 2 and switches
    [status] = await read_status(psettings, event_store=es)
    assert (status.version, status.generation) == (2, 2)
    assert dump(psettings, "account_balances") == await memory_fold(AccountBalancesV2(), es)

    # Older code never downgrades a read model.
    outcomes = await Daemon([AccountBalances()], psettings, event_store=es).run(until_caught_up=True)
    assert outcomes == {"account_balances": Outcome.ERROR}
    [status] = await read_status(psettings, event_store=es)
    assert status.state == "error" and "newer than this code" in str(status.error)

    # Changed tables without a version bump are refused.
    class Changed(AccountBalancesV2):
        tables = (*AccountBalancesV2.tables[:1], Table("closures", key="account_id", columns={"account_id": str}))

    outcomes = await Daemon([Changed()], psettings, event_store=es).run(until_caught_up=True)
    assert outcomes == {"account_balances": Outcome.ERROR}
    [status] = await read_status(psettings, event_store=es)
    assert "Bump `version`" in str(status.error)

    # Without auto_rebuild a bump is reported, not acted upon.
    class V3(AccountBalancesV2):
        version = 3

    manual = psettings.model_copy(update={"auto_rebuild": False})
    outcomes = await Daemon([V3()], manual, event_store=es).run(until_caught_up=True)
    assert outcomes == {"account_balances": Outcome.ERROR}
    [status] = await read_status(psettings, event_store=es)
    assert status.version == 2 and "jetsourcing rebuild" in str(status.error)


async def test_two_rebuilds_at_once_are_refused(es: EventStore, psettings: ProjectionSettings) -> None:
    await append_workload(es, workload(2000, accounts=100))  # ~2 s of SlowBalances
    proc = spawn(psettings, "rebuild", "projection_examples:SlowBalances", "--batch-size", "50",
                 stderr=subprocess.DEVNULL)
    try:
        def started() -> bool:
            with contextlib.closing(open_store(psettings)) as store:
                return any(s.building for s in store.statuses())

        await wait_until(started, 20, "the first rebuild to start")
        with pytest.raises(RebuildError, match="already running"):
            await rebuild(AccountBalancesV2(), psettings, event_store=es)
    finally:
        proc.kill()
        proc.wait()


async def test_ctrl_c_ends_a_rebuild_with_130_and_keeps_its_progress(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(1500, accounts=100))
    await burst([AccountBalances()], psettings, es)
    proc = spawn(psettings, "rebuild", "projection_examples:SlowBalances", "--batch-size", "50",
                 stderr=subprocess.PIPE)
    try:
        await wait_until(lambda: building(psettings) > 0, 30, "the rebuild to make progress")
        proc.send_signal(signal.SIGINT)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = stderr.decode().strip().splitlines()
    assert proc.returncode == 130, stderr
    assert lines[-1].startswith("jetsourcing: Rebuild of 'account_balances' cancelled") and "--resume" in lines[-1]
    assert "Traceback" not in stderr.decode()


@both_stores
async def test_sigterm_keeps_a_rebuilds_progress_and_resumed_rebuilds_go_on_from_it(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(1500, accounts=100))
    await burst([AccountBalances()], psettings, es)
    before = dump(psettings, "account_balances")
    total = await es.last_position()

    proc = spawn(psettings, "rebuild", "projection_examples:SlowBalances", "--batch-size", "50",
                 stderr=subprocess.PIPE)
    await wait_until(lambda: building(psettings) > 0, 20, "the rebuild to make progress")
    proc.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM.value and b"cancelled; readers still see the old model" in stderr
    assert b"jetsourcing rebuild --resume" in stderr
    kept = building(psettings)
    assert 0 < kept < total and dump(psettings, "account_balances") == before
    [status] = await read_status(psettings, event_store=es)
    assert status.rebuild is not None and (status.rebuild.generation, status.rebuild.active) == (2, False)
    assert status.state == "stopped"

    # The daemon's automatic rebuild (version 2 on start) resumes it; stopping the daemon keeps it again.
    small_batches = psettings.model_copy(update={"rebuild_batch_size": 50})
    daemon = Daemon([SlowBalances()], small_batches, event_store=es)
    running = asyncio.create_task(daemon.run())
    await wait_until(lambda: building(psettings) > kept + 100, 20, "the automatic rebuild to go on")
    daemon.stop()
    assert await running == {"account_balances": Outcome.STOPPED}
    [status] = await read_status(psettings, event_store=es)
    assert (status.version, status.generation, status.state) == (1, 1, "stopped")
    assert status.rebuild is not None and status.rebuild.generation == 2 and not status.rebuild.active
    assert dump(psettings, "account_balances") == before
    resumed_from = building(psettings)
    assert kept < resumed_from < total

    left = 0
    async for events in es.read_all(from_position=resumed_from + 1, categories=AccountBalancesV2.categories):
        left += len(events)
    result = await rebuild(AccountBalancesV2(), psettings, event_store=es, resume=True)
    assert (result.generation, result.checkpoint, result.events) == (2, total, left)
    assert dump(psettings, "account_balances") == await memory_fold(AccountBalancesV2(), es)
    assert generation_tables(psettings) == {"balances__g2", "closures__g2"}


async def test_a_rebuild_without_resume_starts_over_and_a_changed_definition_is_not_resumed(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(1500, accounts=100))
    await burst([AccountBalances()], psettings, es)
    stop = asyncio.Event()
    slow = asyncio.create_task(rebuild(SlowBalances(), psettings.model_copy(update={"rebuild_batch_size": 50}),
                                       event_store=es, stop=stop))

    await wait_until(lambda: building(psettings) > 0, 20, "the rebuild to make progress")
    stop.set()
    with pytest.raises(RebuildError, match="resume=True"):
        await slow

    class V3(AccountBalancesV2):
        version = 3

    # Another version cannot take the kept shadow over: it starts from the first event in a new generation.
    result = await rebuild(V3(), psettings, event_store=es, resume=True)
    assert result.generation == 3 and result.checkpoint == await es.last_position()
    assert dump(psettings, "account_balances") == await memory_fold(V3(), es)
    assert generation_tables(psettings) == {"balances__g3", "closures__g3"}

    # Without resume, a rebuild starts over even when a kept shadow would fit.
    class SlowV4(SlowBalances):
        version = 4

    class V4(AccountBalancesV2):
        version = 4

    stop = asyncio.Event()
    slow = asyncio.create_task(rebuild(SlowV4(), psettings.model_copy(update={"rebuild_batch_size": 50}),
                                       event_store=es, stop=stop))
    await wait_until(lambda: building(psettings) > 0, 20, "the second rebuild to make progress")
    stop.set()
    with pytest.raises(RebuildError, match="resume=True"):
        await slow
    result = await rebuild(V4(), psettings, event_store=es)
    assert result.generation == 5  # numbers are never reused, even those of abandoned rebuilds
    assert result.events == sum([len(e) async for e in es.read_all(categories=AccountBalancesV2.categories)])


async def test_a_rebuild_waits_out_a_nats_outage_and_goes_on_from_its_checkpoint(tmp_path: Path) -> None:
    """The outage policy: a server stopped for longer than a request's timeout mid-rebuild is waited out (before,
    the rebuild gave up after one request timeout); the switched-in model equals a clean replay."""
    server = EmbeddedServer(tmp_path / "nats")
    server.start()
    settings = make_settings(server.url, tmp_path / "views.sqlite3")
    settings = settings.model_copy(update={"eventstore": settings.eventstore.model_copy(
        update={"request_timeout_s": 1.0})})
    es = await EventStore.connect(settings.eventstore)
    register_all(es)
    try:
        await append_workload(es, workload(3000, accounts=300))
        await burst([AccountBalances()], settings, es)
        rebuilding = asyncio.create_task(rebuild(SlowBalances(), settings.model_copy(
            update={"rebuild_batch_size": 100}), event_store=es))
        await wait_until(lambda: building(settings) > 0, 30, "the rebuild to start")
        server.stop()
        await asyncio.sleep(3.0)  # three request timeouts: the old rebuild had given up after one
        assert not rebuilding.done()
        server.start()
        async with asyncio.timeout(120):
            result = await rebuilding
        assert result.checkpoint == await es.last_position()
        assert dump(settings, "account_balances") == await clean_rebuild(SlowBalances(), settings, es, tmp_path)
    finally:
        await es.close()
        server.close()


async def test_a_rebuild_whose_event_store_is_closed_under_it_keeps_its_progress(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    """A closed store (EventStoreClosedError, not an outage) interrupts a rebuild as a stop does: the shadow is
    kept for --resume, never dropped as if the projection had failed."""
    await append_workload(es, workload(1500, accounts=100))
    await burst([AccountBalances()], psettings, es)
    total = await es.last_position()
    own = await EventStore.connect(psettings.eventstore)
    register_all(own)
    slow = asyncio.create_task(rebuild(SlowBalances(), psettings.model_copy(update={"rebuild_batch_size": 50}),
                                       event_store=own))
    await wait_until(lambda: building(psettings) > 0, 20, "the rebuild to make progress")
    await own.close()
    with pytest.raises(RebuildError, match="resume=True"):
        await slow
    kept = building(psettings)
    assert 0 < kept < total
    await asyncio.sleep(psettings.lease_ttl_s + 0.5)  # the closed store could not release its lease: it lapses
    result = await rebuild(AccountBalancesV2(), psettings, event_store=es, resume=True)
    assert (result.generation, result.checkpoint) == (2, total)
    assert result.events < sum([len(e) async for e in es.read_all(categories=AccountBalancesV2.categories)])

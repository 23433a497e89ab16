"""Exactly-once under crashes, and following through a server restart."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import time
from pathlib import Path

from eventstore import EmbeddedServer, EventStore, StreamId
from projections import Daemon, MemoryStore, Outcome, ProjectionSettings, fold, read_status

from projection_examples import ACCOUNT, AccountBalances, Deposited, Movements, append_workload, register_all, workload
from projection_helpers import (
    both_stores,
    checkpoint,
    clean_rebuild,
    cli,
    cli_env,
    dump,
    make_settings,
    memory_fold,
    wait_until,
)

ROOT = Path(__file__).parent.parent.parent


class IncrementalFold:
    """The in-memory fold of a projection up to a growing position: what the SQLite model must equal there."""

    def __init__(self, projection: AccountBalances | Movements, es: EventStore) -> None:
        self.projection = projection
        projection.bind(es.registry)
        self.es = es
        self.store = MemoryStore.for_projection(projection)
        self.position = 0

    async def up_to(self, position: int) -> dict[str, list[dict[str, object]]]:
        if position > self.position:
            async for batch in self.es.read_all(from_position=self.position + 1, to_position=position,
                                                categories=self.projection.categories):
                fold(self.projection, batch, self.store)
            self.position = position
        return self.store.dump()


@both_stores
async def test_kill_9_at_random_points_while_20000_events_are_appended(
    es: EventStore, psettings: ProjectionSettings, tmp_path: Path
) -> None:
    settings = psettings.model_copy(update={"lease_ttl_s": 1.0})
    rng = random.Random(2024)
    writer = asyncio.create_task(append_workload(es, workload(20_000, accounts=2000, seed=1), concurrency=12))
    folds = {"account_balances": IncrementalFold(AccountBalances(), es), "movements": IncrementalFold(Movements(), es)}
    checkpoints = {name: 0 for name in folds}
    kills = 0
    args = cli("run", "projection_examples:AccountBalances", "projection_examples:Movements", "--batch-size", "200")
    while not writer.done() or kills < 8:
        proc = subprocess.Popen(args, env=cli_env(settings), cwd=ROOT, stderr=subprocess.DEVNULL)
        # Kill while it applies: once it has moved the checkpoint (or, rarely, during start-up), at a random moment.
        before = checkpoint(settings, "account_balances")
        with contextlib.suppress(AssertionError):
            await wait_until(lambda: checkpoint(settings, "account_balances") > before, rng.uniform(0.5, 5.0))
        await asyncio.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        await asyncio.to_thread(proc.wait)
        kills += 1
        # Whatever the kill interrupted, the model is exactly the fold up to its checkpoint: never half a batch,
        # never an event twice, never a checkpoint that runs ahead of (or behind) its rows.
        for name, incremental in folds.items():
            position = checkpoint(settings, name)
            assert position >= checkpoint_before(checkpoints, name)
            checkpoints[name] = position
            model = dump(settings, name)
            if position == 0 and not model:
                continue  # killed before the daemon had created the read model
            assert model == await incremental.up_to(position), f"{name} after kill {kills}"
    await writer
    assert max(checkpoints.values()) > 0
    # A killed daemon leaves "running" behind; status calls it stale once the heartbeat is old enough.
    await asyncio.sleep(0.6)
    statuses = await read_status(settings.model_copy(update={"stale_after_s": 0.5}), event_store=es)
    assert {s.state for s in statuses} == {"stale"}

    # Restart: resume from the checkpoints and catch up (burst mode, production code path).
    done = await asyncio.to_thread(
        subprocess.run, cli("run", "projection_examples:AccountBalances", "projection_examples:Movements",
                            "--until-caught-up"),
        env=cli_env(settings), cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    last = await es.last_position()
    assert checkpoint(settings, "account_balances") == last
    crashed = {name: dump(settings, name) for name in folds}
    assert crashed["account_balances"] == await clean_rebuild(AccountBalances(), settings, es, tmp_path)
    assert crashed["movements"] == await clean_rebuild(Movements(), settings, es, tmp_path)
    print(f"{kills} kills; checkpoints seen: {checkpoints}")


def checkpoint_before(checkpoints: dict[str, int], name: str) -> int:
    return checkpoints[name]


async def test_following_survives_a_server_restart(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "nats").start()
    try:
        settings = make_settings(server.url, tmp_path / "rm.sqlite3")
        es = await EventStore.connect(settings.eventstore)
        register_all(es)
        try:
            await append_workload(es, workload(500, accounts=50))
            daemon = Daemon([AccountBalances()], settings, event_store=es)
            running = asyncio.create_task(daemon.run())
            last = await es.last_position()
            await wait_until(lambda: checkpoint(settings, "account_balances") == last, 20, "catch-up")

            server.stop()
            await asyncio.sleep(settings.lease_ttl_s + 1)  # longer than the lease TTL: the lease must be re-taken
            server.start()
            account = StreamId(ACCOUNT, "acc-00001")
            started = time.monotonic()
            while True:  # the client reconnects by itself; appends fail until it has
                try:
                    await es.append(account, [Deposited(amount=7)])
                    break
                except Exception:
                    if time.monotonic() - started > 20:
                        raise
                    await asyncio.sleep(0.1)
            await append_workload(es, workload(300, accounts=50, seed=5))
            last = await es.last_position()
            await wait_until(lambda: checkpoint(settings, "account_balances") == last, 30, "following after restart")
            assert not running.done()
            daemon.stop()
            assert await running == {"account_balances": Outcome.STOPPED}
            assert dump(settings, "account_balances") == await memory_fold(AccountBalances(), es)
        finally:
            await es.close()
    finally:
        server.close()

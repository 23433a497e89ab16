"""The demo's steps 1 to 4 (:mod:`samples.demo` runs them; :mod:`samples.spark_demo` is step 5).

Each step narrates through :class:`~samples.report.Report` and turns what it
claims into checks: a claim that does not hold fails the demo.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sqlite3
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from aggregates import CommandClient, CommandRejectedError
from eventstore import EventStore, EventStoreSettings
from projections import (
    Daemon,
    MemoryStore,
    Outcome,
    Projection,
    ProjectionSettings,
    RichProgress,
    SqliteStore,
    fold,
    format_status,
    read_status,
    rebuild,
)
from samples.bank import Account, AccountBalances, Bank, DailyMovements, TransferProcess, TransferStatuses
from samples.bank.commands import Deposit, Withdraw
from samples.bank.workload import FIRST_DAY, Customer, Tally, open_accounts, plan, run_commands
from samples.report import Report

__all__ = [
    "DATABASE",
    "Demo",
    "bank_projections",
    "blue_green",
    "catch_up",
    "commands_over_nats",
    "event_store",
    "money",
    "run_bank",
]

DATABASE = "bank.sqlite3"
"""The SQLite read-model file, in the work directory."""

SIMULATED_CRASHES = 5
"""Process-manager deliveries that fail after their first command, to show idempotent redelivery."""


@dataclass
class Demo:
    """What the steps share."""

    args: argparse.Namespace
    report: Report
    workdir: Path
    store: EventStore
    psettings: ProjectionSettings
    bank: Bank
    customers: list[Customer]
    tally: Tally = field(default_factory=Tally)

    @property
    def database(self) -> Path:
        """The SQLite file of the read models."""
        assert isinstance(self.psettings.database, Path), "the demo keeps its read models in SQLite"
        return self.psettings.database

    def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """What a reader of the read models sees: plain SQL on the views, in a short connection of its own."""
        with contextlib.closing(sqlite3.connect(self.database)) as conn:
            return conn.execute(sql, params).fetchall()


# -- step 1: the event store ------------------------------------------------------


@contextlib.asynccontextmanager
async def event_store(report: Report, workdir: Path) -> AsyncIterator[tuple[EventStore, EventStoreSettings]]:
    """Connect to ``NATS_URL`` if set, else start an embedded nats-server storing into ``workdir``; stop it after."""
    external = os.environ.get("NATS_URL") or os.environ.get("JETSOURCING_NATS_URL")
    if external:
        # A shared server may hold an earlier demo's stream: a fresh stream per run keeps the books clean.
        tag = uuid.uuid4().hex[:8]
        settings = EventStoreSettings(stream=f"BANK_{tag}", subject_prefix=f"bank_{tag}")
    else:
        settings = EventStoreSettings(nats_url=None, storage_dir=workdir / "nats", stream="BANK", subject_prefix="bank")
    started = time.monotonic()
    store = await EventStore.connect(settings)
    try:
        if store.server is not None:
            # Everything else (daemon, status, Spark's readers) connects by URL to the server just started.
            settings = settings.model_copy(update={"nats_url": store.server.url})
            report.done(f"embedded nats-server (pid {store.server.pid}) on {store.server.url}, JetStream files in "
                        f"{store.server.storage_dir} [dim]({time.monotonic() - started:.1f}s)[/]")
        else:
            report.done(f"connected to NATS at {settings.nats_url} (NATS_URL)")
        info = await store.info()
        report.done(f"stream {settings.stream!r} on subjects '{settings.subject_prefix}.>' "
                    f"({info.commits} commits so far; created with deny-delete, deny-purge, no limits)")
        if external:
            report.say(f"[dim]The stream {settings.stream} stays on that server after the demo.[/]")
        yield store, settings
    finally:
        await store.close()


# -- step 2: commands ---------------------------------------------------------------


async def run_bank(demo: Demo) -> None:
    """Open the accounts, run the commands with the process manager alongside, then let it settle."""
    report, tally = demo.report, demo.tally
    started = time.monotonic()
    await open_accounts(demo.bank, demo.customers, tally, concurrency=demo.args.concurrency)
    owners = len({c.owner for c in demo.customers})
    report.done(f"opened {len(demo.customers):,} accounts for {owners:,} owners, each with a first deposit "
                f"[dim]({time.monotonic() - started:.1f}s)[/]")

    _, commands = plan(demo.args.accounts, demo.args.commands, seed=demo.args.seed)
    process = TransferProcess(demo.store, simulate_crashes=SIMULATED_CRASHES, retry_backoff_s=(0.2, 1.0, 5.0))
    live = process.worker(concurrency=16)
    report.say(f"running {len(commands):,} commands, {demo.args.concurrency} in flight; the transfer process "
               f"manager (reactor {TransferProcess.NAME!r}) works alongside and will 'crash' {SIMULATED_CRASHES} "
               "times right after a command, before its acknowledgement")
    worker = asyncio.create_task(live.run())
    started = time.monotonic()
    with _bar(report, "commands", len(commands)) as advance:
        await run_commands(demo.bank, commands, tally, concurrency=demo.args.concurrency, on_done=advance)
    elapsed = time.monotonic() - started
    live.stop()
    await worker
    # What is still pending (the last requests, redeliveries waiting for their backoff) is drained by a
    # burst-mode worker: it returns once the reactor's consumer has nothing pending or in flight.
    drained = await asyncio.wait_for(process.worker(concurrency=16, until_idle=True).run(), 120)
    report.done(f"{len(commands):,} commands in {elapsed:.1f}s ({len(commands) / max(elapsed, 1e-9):,.0f}/s)")
    kinds = ("deposit", "withdraw", "transfer", "request_transfer")
    labels = {"deposit": "deposits", "withdraw": "withdrawals", "transfer": "atomic transfers (save_all)",
              "request_transfer": "transfer requests (process manager)"}
    report.table("", ["command", "accepted", "refused"],
                 [(labels[k], tally.accepted[k], tally.refused[k]) for k in kinds])
    for example in tally.refusals[:2]:
        report.say(f"[dim]refused, e.g. {example}[/]")
    stats = process.stats
    redelivered = live.stats.redelivered + drained.redelivered
    report.done(f"process manager: {live.stats.handled + drained.handled:,} events handled, {stats.commands:,} "
                f"commands issued; {stats.crashes} simulated crashes -> {redelivered} redeliveries")
    report.check("every redelivered step re-ran its command with the same command id and stored nothing new",
                 stats.duplicates == stats.crashes and redelivered >= stats.crashes,
                 f"{stats.duplicates} duplicate commands for {stats.crashes} crashes")
    report.check("the reactor dead-lettered nothing", live.stats.dead_lettered + drained.dead_lettered == 0)


@contextlib.contextmanager
def _bar(report: Report, title: str, total: int) -> Iterator[Any]:
    progress = Progress(TextColumn(f"  [bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=report.console)
    task = progress.add_task(title, total=total)
    with progress:
        yield lambda: progress.advance(task)


# -- step 3: the daemon, burst mode -----------------------------------------------------


def bank_projections() -> list[Projection]:
    """Fresh instances of the bank's read models."""
    return [AccountBalances(), DailyMovements(), TransferStatuses()]


async def catch_up(demo: Demo) -> None:
    """Run the daemon in burst mode, show the read models and check the books."""
    report = demo.report
    report.say("the daemon catches every projection up to the stream's last position and exits -- what "
               f"[bold]jetsourcing run samples.bank:AccountBalances ... --until-caught-up --db {DATABASE}[/] does")
    started = time.monotonic()
    outcomes = await Daemon(bank_projections(), demo.psettings, event_store=demo.store).run(until_caught_up=True)
    report.check("the daemon caught up every projection", all(o is Outcome.CAUGHT_UP for o in outcomes.values()),
                 ", ".join(f"{n}: {o.value}" for n, o in outcomes.items()) + f"; {time.monotonic() - started:.1f}s")
    report.say(f"[bold]jetsourcing status[/] ({demo.database.name}):")
    statuses = await read_status(demo.psettings, event_store=demo.store)
    report.block(format_status(statuses))
    last = await demo.store.last_position()
    report.check("checkpoints are at the stream's last position, lag 0",
                 all(s.checkpoint == last and s.lag_commits == 0 for s in statuses), f"last position {last:,}")

    richest = demo.query("SELECT account_id, owner, balance, movements, last_position FROM balances "
                         "ORDER BY balance DESC, account_id LIMIT 5")
    report.table("account_balances: the five largest balances", ["account", "owner", "balance", "movements",
                 "last position"], [(a, o, money(b), m, p) for a, o, b, m, p in richest])
    days = demo.query("SELECT day, count(*), sum(deposits), sum(withdrawals), sum(transfers_in), sum(transfers_out), "
                      "sum(net) FROM daily GROUP BY day ORDER BY day")
    report.table("daily_movements: totals per value date", ["day", "accounts", "deposits", "withdrawals",
                 "transfers in", "transfers out", "net"],
                 [(d, n, money(a), money(b), money(c), money(e), money(f)) for d, n, a, b, c, e, f in days])
    transfers = demo.query("SELECT status, count(*), sum(amount) FROM transfers GROUP BY status ORDER BY status")
    report.table("transfer_statuses: process-manager transfers", ["status", "transfers", "amount"],
                 [(s, n, money(a)) for s, n, a in transfers])
    failed = demo.query("SELECT transfer_id, reason FROM transfers WHERE status = 'failed' AND reason LIKE 'credit%' "
                        "ORDER BY transfer_id LIMIT 1")
    if failed:
        report.say(f"[dim]e.g. {failed[0][0]}: {failed[0][1][:110]} -> debit paid back[/]")

    [(count, total, lowest)] = demo.query("SELECT count(*), sum(balance), min(balance) FROM balances")
    [(net,)] = demo.query("SELECT sum(net) FROM daily")
    expected = demo.tally.money_in_bank
    report.check("money is conserved: the balances add up to cash in minus cash out",
                 total == expected == net, f"{money(total)} in {count:,} accounts")
    report.check("no account is overdrawn", lowest >= 0, f"lowest balance {money(lowest)}")
    settled = sum(n for s, n, _ in transfers if s in ("completed", "failed"))
    report.check("every process-manager transfer reached an end (completed, or failed and paid back)",
                 settled == demo.tally.accepted["request_transfer"],
                 f"{settled:,} of {demo.tally.accepted['request_transfer']:,}")


def money(cents: int | None) -> str:
    """Cents as a readable amount."""
    return "-" if cents is None else f"{cents / 100:,.2f}"


# -- step 4: commands over NATS ------------------------------------------------------------

NATS_WORKERS = 2
"""Processes of ``jetsourcing serve`` the demo starts in one queue group."""


async def commands_over_nats(demo: Demo) -> None:
    """Serve the bank's commands from two worker processes, send deposits and overdrafts over NATS, stop the
    workers with SIGTERM, and read the new balances from the read model."""
    report, settings = demo.report, demo.psettings.eventstore
    prefix = f"{settings.stream.lower()}_cmd"
    report.say(f"{NATS_WORKERS} worker processes serve the bank's account commands in one NATS queue group -- "
               "[bold]jetsourcing serve samples.bank.commands:command_service[/] in each")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_")}
    env.update({"NATS_URL": settings.nats_url or "", "JETSOURCING_STREAM": settings.stream,
                "JETSOURCING_SUBJECT_PREFIX": settings.subject_prefix,
                "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])})
    workers = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "projections.cli", "serve", "samples.bank.commands:command_service",
            "--command-prefix", prefix, env=env, stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(NATS_WORKERS)
    ]
    try:
        for worker in workers:
            assert worker.stderr is not None
            async with asyncio.timeout(30):
                while b"serving " not in (line := await worker.stderr.readline()):
                    if not line:
                        raise RuntimeError(f"a command worker (pid {worker.pid}) ended before serving")
        # Keep reading what the workers log, so that a full pipe never blocks one.
        drains = [asyncio.create_task(_discard(w.stderr)) for w in workers if w.stderr is not None]
        report.done(f"{NATS_WORKERS} workers serve {prefix}.Account.{{OpenAccount,Deposit,Withdraw}} "
                    f"(pids {', '.join(str(w.pid) for w in workers)})")
        chosen = [c.account_id for c in demo.customers[:20]]
        before = dict(demo.query(
            f"SELECT account_id, balance FROM balances WHERE account_id IN ({','.join('?' * len(chosen))})", chosen
        ))
        client = CommandClient(demo.store, subject_prefix=prefix)
        day, amount, rounds = FIRST_DAY + timedelta(days=40), 100, 10
        started = time.monotonic()
        replies = await asyncio.gather(*(
            client.send(Account, account, Deposit(amount=amount, value_date=day), command_id=f"nats-{account}-{n}")
            for n in range(rounds) for account in chosen
        ))
        seconds = time.monotonic() - started
        demo.tally.cash_in += amount * len(replies)
        demo.tally.accepted["deposit over NATS"] += len(replies)
        report.check("every deposit sent over NATS was answered, and stored once",
                     len({r.command_id for r in replies}) == len(replies) and not any(r.duplicate for r in replies),
                     f"{len(replies)} deposits in {seconds:.1f}s")
        refused, example, overdrawn = 0, "", chosen[:5]
        for account in overdrawn:
            try:
                await client.send(Account, account, Withdraw(amount=10**12, value_date=day))
            except CommandRejectedError as exc:
                refused += exc.error_type == "InsufficientFunds"
                example = str(exc)
        report.check("an overdraft over NATS is refused with the aggregate's own error", refused == len(overdrawn),
                     f"InsufficientFunds, e.g. {example[:90]}")
        started = time.monotonic()
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            codes = [await worker.wait() for worker in workers]
        report.check("on SIGTERM the workers drained and exited 0", codes == [0] * NATS_WORKERS,
                     f"exit codes {codes} in {time.monotonic() - started:.1f}s")
        await asyncio.gather(*drains)
    finally:
        for worker in workers:
            if worker.returncode is None:
                worker.kill()
                await worker.wait()
    await Daemon(bank_projections(), demo.psettings, event_store=demo.store).run(until_caught_up=True)
    after = dict(demo.query(
        f"SELECT account_id, balance FROM balances WHERE account_id IN ({','.join('?' * len(chosen))})", chosen
    ))
    report.table("account_balances after the commands over NATS (read model)", ["account", "before", "after"],
                 [(a, money(before[a]), money(after[a])) for a in chosen[:5]])
    report.check("the read model shows each balance raised by the deposits over NATS",
                 all(after[a] == before[a] + rounds * amount for a in chosen), f"{len(chosen)} accounts")


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


# -- step 5: blue/green rebuild ------------------------------------------------------------


async def blue_green(demo: Demo) -> None:
    """Rebuild account_balances into a new generation while the daemon follows live and a writer appends."""
    report, store = demo.report, demo.store
    name = AccountBalances.name
    daemon = Daemon(bank_projections(), demo.psettings, event_store=store)
    following = asyncio.create_task(daemon.run())
    stop_writing = asyncio.Event()
    writes = asyncio.create_task(_keep_depositing(demo, stop_writing))
    seen: list[tuple[int, int, int]] = []  # (generation, checkpoint, rows) as readers saw them
    stop_reading = asyncio.Event()
    reads = asyncio.create_task(_keep_reading(demo, stop_reading, seen))
    try:
        await asyncio.sleep(0.5)  # let the daemon take the live generation and the writer get going
        before = _live(demo, name)
        report.say(f"the daemon follows live (generation {before[0]}), a writer keeps depositing, readers keep "
                   "querying; the rebuild replays the whole stream into a shadow generation, then switches")
        progress = RichProgress(f"rebuild {name}", console=report.console)
        # On a very slow machine the replay could trail the writer for long: the writer then goes home.
        watchdog = asyncio.get_running_loop().call_later(30, stop_writing.set)
        result = await rebuild(AccountBalances(), demo.psettings, event_store=store, progress=progress)
        watchdog.cancel()
        report.done(f"switched {name}: generation {before[0]} -> {result.generation} at checkpoint "
                    f"{result.checkpoint:,} ({result.events:,} events replayed in {result.seconds:.1f}s, "
                    f"{result.events_per_s:,.0f} events/s)")
        await asyncio.sleep(0.5)  # writes after the switch: the daemon must notice and move to the new generation
    finally:
        stop_writing.set()
        deposits = await writes
    last = await store.last_position()
    caught_up = await _wait_for(lambda: _live(demo, name)[1] >= last, 30)
    stop_reading.set()
    await reads
    daemon.stop()
    outcomes = await following
    report.done(f"the writer made {deposits:,} deposits meanwhile; readers queried {len(seen):,} times and saw "
                f"generations {sorted({g for g, _, _ in seen})} at checkpoints {min(c for _, c, _ in seen):,}.."
                f"{max(c for _, c, _ in seen):,}")
    report.check("readers always saw a whole read model (every account, never a half-built shadow)",
                 all(rows == len(demo.customers) for _, _, rows in seen))
    after = _live(demo, name)
    report.check("the daemon moved to the new generation and caught up with the writer",
                 caught_up and after[0] == result.generation and outcomes[name] is Outcome.STOPPED,
                 f"generation {after[0]} at checkpoint {after[1]:,} = last position {last:,}")
    clean = await _fold(AccountBalances(), store)
    with SqliteStore(demo.database) as rm:
        served = rm.dump(name)
    report.check("the switched-in read model equals a clean replay of the whole stream (in-memory fold)",
                 served == clean, f"{len(served['balances']):,} rows")


async def _keep_depositing(demo: Demo, stop: asyncio.Event) -> int:
    """Deposit into random accounts at about 100 a second (a busy branch, not a load test) until ``stop``.

    The rate matters: a rebuild switches once its replay has caught up with
    the live model, so a writer appending as fast as the replay reads would
    keep it chasing.
    """
    rng = random.Random(demo.args.seed + 1)
    ids = [c.account_id for c in demo.customers]
    done = 0

    async def one() -> None:
        nonlocal done
        while not stop.is_set():
            amount = rng.randrange(1_00, 100_00)
            await demo.bank.deposit(rng.choice(ids), amount, FIRST_DAY + timedelta(days=4))
            demo.tally.cash_in += amount
            demo.tally.accepted["deposit"] += 1
            done += 1
            await asyncio.sleep(0.02)

    await asyncio.gather(one(), one())
    return done


async def _keep_reading(demo: Demo, stop: asyncio.Event, seen: list[tuple[int, int, int]]) -> None:
    """Query the live read model every 20 ms, as a dashboard would."""
    with SqliteStore(demo.database) as rm:
        while not stop.is_set():
            live = rm.live_generation(AccountBalances.name)
            [(rows,)] = demo.query("SELECT count(*) FROM balances")
            if live is not None:
                seen.append((live.generation, live.checkpoint, rows))
            await asyncio.sleep(0.02)


def _live(demo: Demo, name: str) -> tuple[int, int]:
    """(generation, checkpoint) of the live read model ``name``."""
    with SqliteStore(demo.database) as rm:
        live = rm.live_generation(name)
    return (live.generation, live.checkpoint) if live is not None else (0, 0)


async def _wait_for(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _fold(projection: Projection, store: EventStore) -> dict[str, list[dict[str, Any]]]:
    """The read model a clean replay gives: every event of the projection's categories folded in memory."""
    projection.bind(store.registry)
    memory = MemoryStore.for_projection(projection)
    async for batch in store.read_all(categories=projection.categories):
        fold(projection, batch, memory)
    return memory.dump()



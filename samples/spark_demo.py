"""Step 5 of the demo: the bank's read models in Spark and Delta Lake, straight from JetStream.

* The daemon's own projection class (:class:`~samples.bank.AccountBalances`)
  is rebuilt by Spark into a Delta table: the same handlers, folded per
  account in parallel tasks that read the stream directly. The table must
  equal the SQLite read model at the same stream position. (Every projection
  of :mod:`samples.bank.projections` runs in Spark the same way; the demo
  keeps to one to stay quick.)
* A DataFrame projection (:data:`~samples.bank.spark.DAILY_TOTALS`) aggregates
  across accounts, which a per-account fold cannot; it must equal the SQLite
  daily rows summed per day.
* More commands are appended, then an incremental update reads only the new
  events and merges them; the result is compared again, and the Delta
  history shows which stream position each table version reflects.
* Then Spark follows the stream continuously (:func:`~spark_projections.follow`,
  a Structured Streaming query): more commands land in the Delta tables within
  seconds, micro-batch by micro-batch, and the tables equal SQLite again.

Spark calls block, so they run in a thread: the event loop (and with it the
NATS connection's keep-alives) stays responsive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pyspark.sql import SparkSession

from projections import Daemon, Outcome, Projection, SqliteStore
from samples.bank import AccountBalances, TransferProcess
from samples.bank.spark import DAILY_TOTALS
from samples.bank.workload import plan, run_commands
from samples.steps import Demo, bank_projections, money
from spark_projections import (
    GROUP_COLUMN,
    DataFrameProjection,
    ProjectionRun,
    SparkSettings,
    follow,
    rebuild,
    spark_session,
    table_history,
    update,
)

__all__ = ["DELTA_JARS_MB", "run_spark", "spark_settings"]

DELTA_JARS_MB = 90
"""What a first start on a machine downloads, in MB: the Delta jars and what they need (33 jars of 89 MB, measured
for Delta 4.4.0 on Spark 4.2; a test compares it with the jars of its session)."""

T = TypeVar("T")

_TOTALS_SQL = (
    "SELECT day, sum(deposits), sum(withdrawals), sum(transfers_in), sum(transfers_out), sum(net), sum(movements) "
    "FROM daily GROUP BY day ORDER BY day"
)
_TOTALS_COLUMNS = ("day", "deposits", "withdrawals", "transfers_in", "transfers_out", "net", "movements")


def spark_settings(startup_log: Path) -> SparkSettings:
    """A local session sized for a laptop: every core, few shuffle partitions, quiet logs, UTC; the JVM's start-up
    output (the Ivy report) in ``startup_log``."""
    return SparkSettings(
        startup_log=startup_log,
        master="local[*]",
        app_name="jetsourcing-demo",
        shuffle_partitions=4,
        log_level="ERROR",
        extra_conf={
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.session.timeZone": "UTC",
            # A short-lived JVM: the C2 compiler costs more than it saves before the demo ends.
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
        },
    )


async def _blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.to_thread(fn, *args, **kwargs)


async def run_spark(demo: Demo) -> None:
    """Rebuild into Delta, compare with SQLite, append, update incrementally, compare again, show history."""
    report = demo.report
    report.say("starting Spark with Delta Lake. [bold]The first run on a machine downloads the Delta jars from "
               f"Maven Central[/] (about {DELTA_JARS_MB} MB, kept in ~/.cache/jetsourcing/delta-jars for later runs, "
               "which start in seconds; offline: JETSOURCING_SPARK_DELTA_JARS_DIR)")
    started = time.monotonic()
    log = demo.workdir / "spark-startup.log"
    spark = await _blocking(spark_session, spark_settings(log))  # an error names the log
    report.done(f"Spark {spark.version} ({spark.sparkContext.master}) with Delta Lake, ready in "
                f"{time.monotonic() - started:.1f}s [dim](start-up log: {log.name})[/]")
    root = demo.workdir / "delta"
    fold_projections: list[Projection] = [AccountBalances()]
    everything: list[Projection | DataFrameProjection] = [*fold_projections, DAILY_TOTALS]
    try:
        report.say(f"full rebuild from JetStream into Delta tables under {root}: the daemon's projection classes "
                   "(folded per account), plus a DataFrame projection (daily_totals)")
        for projection in everything:
            await _run(demo, spark, rebuild, projection, root)
        await _compare(demo, spark, root, fold_projections, "after the rebuild")

        await _append_more(demo)
        report.say("incremental update: only the events after each table's recorded position are read and merged")
        for projection in everything:
            await _run(demo, spark, update, projection, root)
        await _compare(demo, spark, root, fold_projections, "after the incremental update")
        again = await _blocking(update, spark, AccountBalances(), demo.psettings.eventstore, root)
        report.check("an update with nothing new changes nothing", again.mode == "noop", f"mode {again.mode}")

        await _follow(demo, spark, root, fold_projections)

        history = await _blocking(table_history, spark, root / "balances")
        report.table("Delta history of balances (account_balances)", ["version", "operation", "mode",
                     "stream position"], [(h.version, h.operation, h.mode or "-", h.position or "-")
                                          for h in history])
    finally:
        await _blocking(spark.stop)


async def _run(
    demo: Demo,
    spark: SparkSession,
    how: Callable[..., ProjectionRun],
    projection: Projection | DataFrameProjection,
    root: Path,
) -> ProjectionRun:
    started = time.monotonic()
    run = await _blocking(how, spark, projection, demo.psettings.eventstore, root)
    tables = ", ".join(f"{name} (table v{r.table_version})" for name, r in run.tables.items()) or "no table written"
    positions = (f"positions {run.from_position:,}..{run.position:,}" if run.mode != "noop"
                 else f"at position {run.position:,}")
    elapsed = time.monotonic() - started
    demo.report.done(f"{run.projection}: {run.mode}, {positions} -> {tables} [dim]({elapsed:.1f}s)[/]")
    return run


def _delta_rows(spark: SparkSession, path: Path, drop: tuple[str, ...] = (GROUP_COLUMN,)) -> list[dict[str, Any]]:
    """Every row of a Delta table as plain dicts (without the fold's bookkeeping column)."""
    frame = spark.read.format("delta").load(str(path))
    frame = frame.drop(*[c for c in drop if c in frame.columns])
    return [row.asDict() for row in frame.collect()]


async def _follow(demo: Demo, spark: SparkSession, root: Path, projections: list[Projection]) -> None:
    """Follow the stream with a streaming query while more commands arrive; compare once it has caught up."""
    report = demo.report
    report.say("continuous: a Structured Streaming query follows the stream into the same Delta tables, a "
               "micro-batch a second, each MERGE exactly once per stream position (jetsourcing spark follow)")
    settings = demo.psettings.eventstore
    followers = [await _blocking(follow, spark, projection, settings, root, trigger_s=1.0) for projection in projections]
    try:
        before = await demo.store.last_position()
        await _append_more(demo)
        started = time.monotonic()
        for projection, follower in zip(projections, followers):
            last = before
            async for batch in demo.store.read_all(from_position=before + 1, categories=projection.categories):
                last = batch[-1].position
            while (follower.status is None or follower.status.position < last) and follower.active:
                if time.monotonic() - started > 300:
                    raise TimeoutError(f"the follower of {projection.name} did not reach position {last:,} in 300s")
                await asyncio.sleep(0.2)
            status = follower.status
            if follower.error is not None or status is None:
                raise RuntimeError(f"the follower of {projection.name} failed: {follower.error}")
            report.done(f"{projection.name}: followed to position {status.position:,} in "
                        f"{status.batch_id + 1} micro-batches (the last one: {status.positions:,} positions in "
                        f"{status.seconds:.1f}s)")
    finally:
        for follower in followers:
            await _blocking(follower.stop)
    await _compare(demo, spark, root, projections, "after following the stream", totals=False)


async def _compare(
    demo: Demo, spark: SparkSession, root: Path, projections: list[Projection], when: str, totals: bool = True
) -> None:
    report = demo.report
    with SqliteStore(demo.database) as rm:
        checkpoints = {}
        for projection in projections:
            live = rm.live_generation(projection.name)
            checkpoints[projection.name] = live.checkpoint if live else 0
            served = rm.dump(projection.name)
            for table in projection.tables:
                rows = await _blocking(_delta_rows, spark, root / table.name)
                rows.sort(key=lambda r: table.key_values(table.key_of(r)))
                report.check(f"Delta table {table.name} equals the SQLite read model {projection.name} ({when})",
                             rows == served[table.name], f"{len(rows):,} rows at position "
                             f"{checkpoints[projection.name]:,}")
    if not totals:
        return
    daily = sorted(await _blocking(_delta_rows, spark, root / DAILY_TOTALS.name, ()), key=lambda r: str(r["day"]))
    expected = [dict(zip(_TOTALS_COLUMNS, row)) for row in demo.query(_TOTALS_SQL)]
    report.check(f"DataFrame projection daily_totals equals the SQLite daily rows summed per day ({when})",
                 daily == expected, f"{len(daily)} days, net {money(sum(r['net'] for r in daily))}")


async def _append_more(demo: Demo) -> None:
    """More business: commands, the process manager settling the new transfers, the daemon catching up."""
    count = max(50, demo.args.commands // 5)
    _, commands = plan(demo.args.accounts, count, seed=demo.args.seed + 7, prefix="later-")
    before = await demo.store.last_position()
    await run_commands(demo.bank, commands, demo.tally, concurrency=demo.args.concurrency)
    await asyncio.wait_for(TransferProcess(demo.store).worker(concurrency=16, until_idle=True).run(), 120)
    outcomes = await Daemon(bank_projections(), demo.psettings, event_store=demo.store).run(until_caught_up=True)
    after = await demo.store.last_position()
    demo.report.done(f"appended {count:,} more commands (positions {before + 1:,}..{after:,}); the SQLite daemon "
                     f"caught up ({', '.join(sorted({o.value for o in outcomes.values()}))})")
    if any(o is not Outcome.CAUGHT_UP for o in outcomes.values()):
        demo.report.check("the daemon caught up again", False, str(outcomes))

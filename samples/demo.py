"""The jetsourcing demo: a small bank, end to end, on a real nats-server (``make demo``).

1. Start an embedded nats-server in a work directory (or use ``NATS_URL``)
   and connect the event store.
2. Open accounts and run a few thousand commands concurrently: deposits,
   withdrawals (overdrafts are refused), atomic transfers (``save_all``), and
   transfers carried out by a process manager (a reactor), with simulated
   crashes to show that redeliveries change nothing.
3. Run the projection daemon in burst mode into a SQLite file; show rows,
   status, and check the books (money is conserved, nothing overdrawn).
4. Serve the bank's commands over NATS from two ``jetsourcing serve`` worker
   processes in one queue group; send deposits and overdrafts with a
   ``CommandClient``, stop the workers with SIGTERM, and read the new balances
   from the read model.
5. Rebuild a read model blue/green while a writer keeps appending and the
   daemon keeps following; show the switch, and check the result against a
   clean replay.
6. Spark: rebuild the same projections into Delta tables straight from
   JetStream, check them against the SQLite read models, append more, run an
   incremental update and show the Delta history with its stream positions.

Exit status 0 when every check holds, 1 otherwise (with what failed).
``python -m samples.demo --help`` lists the options.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from projections import ProjectionSettings
from samples.bank import Bank
from samples.bank.workload import plan
from samples.report import Report
from samples.steps import DATABASE, Demo, blue_green, catch_up, commands_over_nats, event_store, money, run_bank

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's command line."""
    parser = argparse.ArgumentParser(
        prog="python -m samples.demo", description="jetsourcing end to end: a small bank on NATS JetStream."
    )
    parser.add_argument("--accounts", type=int, default=1000, help="accounts to open (default: 1000)")
    parser.add_argument("--commands", type=int, default=3000, help="commands to run after opening (default: 3000)")
    parser.add_argument("--concurrency", type=int, default=64, help="commands in flight at once (default: 64)")
    parser.add_argument("--seed", type=int, default=2025, help="seed of the workload (default: 2025)")
    parser.add_argument("--skip-spark", action="store_true", help="leave out the Spark and Delta step (quick runs)")
    parser.add_argument("--workdir", type=Path,
                        help="keep the outputs (server storage, SQLite, Delta tables) here instead of a temp dir")
    args = parser.parse_args(argv)
    if args.accounts < 2 or args.commands < 0 or args.concurrency < 1:
        parser.error("--accounts must be at least 2, --commands at least 0, --concurrency at least 1.")
    return args


async def spark_step(demo: Demo) -> None:
    """Step 5: rebuild into Delta from JetStream, compare with SQLite, append, update incrementally, show history."""
    from samples.spark_demo import run_spark  # imported here: --skip-spark never loads pyspark

    await run_spark(demo)


# -- main ----------------------------------------------------------------------------------


@contextlib.contextmanager
def work_directory(path: Path | None, report: Report) -> Iterator[Path]:
    """``path`` (created; a previous demo's outputs in it are replaced), or a temp dir removed afterwards."""
    if path is None:
        with tempfile.TemporaryDirectory(prefix="jetsourcing-demo-") as tmp:
            yield Path(tmp)
        return
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    ours = (path / "nats", path / "delta", path / "spark-startup.log", *path.glob(f"{DATABASE}*"))
    old = [p for p in ours if p.exists()]
    if old:
        report.say(f"[dim]replacing the outputs of an earlier run in {path}[/]")
        for p in old:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    yield path


async def run(args: argparse.Namespace, report: Report) -> None:
    """Run every step; a failed check is recorded in ``report``, an unexpected error propagates."""
    started = time.monotonic()
    report.console.rule("[bold]jetsourcing demo: a small bank on NATS JetStream[/]")
    report.say(f"{args.accounts:,} accounts, {args.commands:,} commands, seed {args.seed}"
               + ("" if not args.skip_spark else ", without Spark (--skip-spark)"))
    with work_directory(args.workdir, report) as workdir:
        report.say(f"work directory: {workdir}" + ("" if args.workdir else " [dim](removed at the end; "
                                                                             "--workdir DIR keeps it)[/]"))
        report.step("Event store")
        async with event_store(report, workdir) as (store, settings):
            psettings = ProjectionSettings(
                eventstore=settings,
                database=workdir / DATABASE,
                lease_bucket=f"{settings.stream}_leases",
                status_interval_s=0.5,
            )
            customers, _ = plan(args.accounts, args.commands, seed=args.seed)
            demo = Demo(args, report, workdir, store, psettings, Bank(store), customers)
            report.step("Commands: accounts, transfers, a process manager")
            await run_bank(demo)
            report.step("Projection daemon (burst mode) into SQLite")
            await catch_up(demo)
            report.step("Commands over NATS: two workers in a queue group")
            await commands_over_nats(demo)
            report.step("Blue/green rebuild while writing")
            await blue_green(demo)
            if not args.skip_spark:
                report.step("Spark: the same projections into Delta Lake")
                await spark_step(demo)
            report.end_step()
            events = (await store.info()).commits
        summary(report, demo, events, time.monotonic() - started)


def summary(report: Report, demo: Demo, commits: int, seconds: float) -> None:
    """The closing table: step times, what was stored, checks."""
    report.console.print()
    report.console.rule("[bold]Summary", align="left")
    report.table("", ["step", "seconds"], [(title, round(s, 1)) for title, s in report.timings])
    tally = demo.tally
    report.say(f"{sum(tally.accepted.values()):,} commands accepted, {sum(tally.refused.values()):,} refused; "
               f"{commits:,} commits in the stream; money in the bank {money(tally.money_in_bank)}")
    if demo.args.workdir:
        report.say(f"outputs kept in {demo.workdir}: read models in {DATABASE}"
                   + ("" if demo.args.skip_spark else ", Delta tables in delta/"))
    ok = len(report.checks) - len(report.failed)
    colour = "green" if not report.failed else "red"
    report.console.print(f"  [bold {colour}]{ok}/{len(report.checks)} checks passed[/] in {seconds:.0f}s")


class _DropSimulatedCrashes(logging.Filter):
    """The reactor logs each failed delivery; the demo's own crashes are announced and counted instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SimulatedCrash" not in record.getMessage()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (0: every check held)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="  %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropSimulatedCrashes())
    steps = 5 if args.skip_spark else 6
    report = Report(steps)
    try:
        asyncio.run(run(args, report))
    except KeyboardInterrupt:
        report.console.print("\n[bold red]Interrupted.[/]")
        return 130
    except Exception as exc:  # noqa: BLE001 - the demo's last word must say what broke, then exit non-zero
        report.console.print_exception(max_frames=8)
        where = f" during step '{report.current_step}'" if report.current_step else ""
        failed_checks(report)
        report.console.print(f"\n[bold red]The demo failed{where}: {type(exc).__name__}: {exc}[/]")
        if report.current_step.startswith("Spark") and not report.failed:
            report.console.print("Everything before Spark worked; `python -m samples.demo --skip-spark` leaves it out.")
        return 1
    if report.failed:
        failed_checks(report)
        report.console.print(f"[bold red]The demo ran, but {len(report.failed)} of its checks failed.[/]")
        return 1
    return 0


def failed_checks(report: Report) -> None:
    """List the checks that failed so far (none: nothing printed)."""
    if report.failed:
        report.console.print("[bold red]These checks failed:[/]")
        for check in report.failed:
            report.console.print(f"  ✗ {check.claim} ({check.detail})")

if __name__ == "__main__":
    sys.exit(main())

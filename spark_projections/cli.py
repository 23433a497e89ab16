"""``jetsourcing spark``: operate the Spark side of jetsourcing from a shell.

Sub-commands:

* ``check`` - start a session from ``JETSOURCING_SPARK_*`` settings, do a Delta round trip
  in a temporary folder and print what was used (Java, Spark, jars, start-up time);
* ``fetch-delta-jars DIR`` - resolve the Delta jars online and copy them into ``DIR``, for
  machines without network access (``JETSOURCING_SPARK_DELTA_JARS_DIR=DIR``);
* ``rebuild module:Projection --root DIR`` / ``update module:Projection --root DIR`` -
  materialise a projection into Delta tables under ``DIR`` (see
  :mod:`spark_projections.projection`). Spark runs locally by default; any master with
  ``--master`` or ``JETSOURCING_SPARK_MASTER`` (e.g. ``spark://host:7077``);
* ``follow module:Projection --root DIR`` - keep the tables up to date with a streaming query
  until SIGTERM, and ``status`` - where it is (:mod:`spark_projections.follow_command`).

Exit codes, as every ``jetsourcing`` command's (:mod:`eventstore.exit_codes`): 0 success; 1 a
failure, explained in one paragraph without a stack trace (a
:class:`~spark_projections.errors.SparkProjectionError`); 2 a usage error (arguments, a
:class:`~spark_projections.errors.SparkUsageError`: an import path, a ``JETSOURCING_SPARK_*``
value); 130 after Ctrl-C and 143 after SIGTERM, within a moment and with one line
(:mod:`spark_projections.interrupt`; ``follow`` stops after its micro-batch, and exits 0 after
SIGTERM, its normal stop).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from typing import Any

from pydantic import ValidationError
from pyspark.sql import SparkSession

from eventstore import EventStoreSettings, ImportPathError, import_object
from eventstore.exit_codes import FAILURE, USAGE, add_exit_codes
from projections import ErrorPolicy, Projection
from spark_projections.errors import SparkProjectionError, SparkUsageError
from spark_projections.interrupt import ExitOnSignal
from spark_projections.delta import WriteResult, table_history
from spark_projections.projection import AnyProjection, DataFrameProjection, last_position, rebuild, update
from spark_projections.settings import SparkSettings, check_master

__all__ = [
    "add_commands",
    "add_common_options",
    "add_stream_options",
    "at_least_one",
    "event_store_settings",
    "load",
    "main",
    "new_session",
    "run_command",
    "spark_settings",
    "stage_printer",
    "start_spark",
]


def main(argv: Sequence[str] | None = None, *, spark: SparkSession | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``) and return the exit status.

    ``spark``: a session to use as it is instead of starting one (tests, notebooks); ``--master`` and
    ``--shuffle-partitions`` only apply to a session the command starts.
    """
    parser = argparse.ArgumentParser(
        prog="jetsourcing spark", description="Operate the Spark side of jetsourcing.",
        epilog="examples: jetsourcing spark check | "
        "jetsourcing spark rebuild myapp.views:AccountBalances --root /lake/accounts"
    )
    add_exit_codes(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    add_exit_codes(commands.add_parser("check", help="start Spark with Delta and do a Delta round trip",
                                       epilog="example: jetsourcing spark check"))
    fetch = commands.add_parser(
        "fetch-delta-jars", help="download the Delta jars into a folder for offline use",
        epilog="example: jetsourcing spark fetch-delta-jars /opt/delta-jars, then "
        "JETSOURCING_SPARK_DELTA_JARS_DIR=/opt/delta-jars on the offline machine",
    )
    fetch.add_argument("dest", type=Path, help="folder to copy the jars into (created)")
    fetch.add_argument("--delta-version", help="Delta version to resolve (default: settings)")
    add_exit_codes(fetch)
    add_commands(commands)
    from spark_projections.follow_command import add_follow_commands, run_follow, run_status

    add_follow_commands(commands)
    args = parser.parse_args(argv)
    try:
        with ExitOnSignal(_OUTCOMES.get(args.command, "nothing was changed.")) as signals:
            if args.command == "check":
                return _check(signals)
            if args.command in ("rebuild", "update"):
                return run_command(args, spark, signals)
            if args.command == "follow":
                return run_follow(args, spark, signals)
            if args.command == "status":
                return run_status(args)
            return _fetch(args.dest, args.delta_version, signals)
    except SparkProjectionError as exc:
        print(f"jetsourcing: {exc}", file=sys.stderr)
        return USAGE if isinstance(exc, SparkUsageError) else FAILURE


# What an interrupted command leaves (the rest of its one line; see spark_projections.interrupt).
_WHOLE_COMMITS = ("each Delta table keeps its last whole commit (a commit is all or nothing, so none is "
                  "half-written). Run the command again to bring them all up to date.")
_OUTCOMES = {
    "rebuild": _WHOLE_COMMITS,
    "update": _WHOLE_COMMITS,
    "follow": _WHOLE_COMMITS,
    "fetch-delta-jars": "the folder may hold part of the jars; run the command again before using it.",
}


def load(path: str) -> AnyProjection:
    """Import ``module:attr``: a Projection subclass or instance, or a DataFrameProjection; else
    :class:`SparkUsageError` saying why."""
    try:
        obj = import_object(path)
    except ImportPathError as exc:
        raise SparkUsageError(str(exc)) from exc
    if isinstance(obj, type) and issubclass(obj, Projection):
        obj = obj()
    if isinstance(obj, (Projection, DataFrameProjection)):
        return obj
    raise SparkUsageError(f"{path!r} is {obj!r}, not a Projection or DataFrameProjection.")


def add_commands(commands: Any) -> None:
    """Add the ``rebuild`` and ``update`` sub-commands to an argparse sub-parsers object."""
    for name, help_text in (
        ("rebuild", "compute a projection's tables from the whole history into Delta (one commit per table)"),
        ("update", "merge the events after the tables' recorded position into Delta (rebuilds if needed)"),
    ):
        command = commands.add_parser(
            name, help=help_text,
            epilog=f"example: jetsourcing spark {name} myapp.views:AccountBalances --root /lake/accounts --partitions 4",
        )
        add_exit_codes(command)
        add_common_options(command)
        command.add_argument("--to-position", type=int, help="last stream position to include (default: the last)")


def add_common_options(command: argparse.ArgumentParser) -> None:
    """Add what every command that runs a projection in Spark takes: the projection, ``--root``, where the events
    are (``--nats-url``, ``--stream``, ``--subject-prefix``), ``--partitions``, and the Spark session's
    ``--master`` and ``--shuffle-partitions`` (:func:`spark_settings`). Invalid values are refused by argparse:
    a one-line error and exit status 2."""
    add_stream_options(command)
    command.add_argument("--partitions", type=at_least_one, metavar="N",
                         help="parallel stream reads (default: Spark's parallelism)")
    command.add_argument("--error-policy", choices=[p.value for p in ErrorPolicy],
                         help="what a handler error does (default: the projection's own): stop and name it, or "
                         "record the commit in <root>/_dead_letters and go on")
    defaults = SparkSettings.model_fields
    command.add_argument("--master", type=_master,
                         help="Spark master, e.g. local[2] or spark://host:7077 (JETSOURCING_SPARK_MASTER; "
                         f"default {defaults['master'].default})")
    command.add_argument("--shuffle-partitions", type=at_least_one, metavar="N",
                         help="Spark's shuffle partitions, at least 1 (JETSOURCING_SPARK_SHUFFLE_PARTITIONS; "
                         f"default {defaults['shuffle_partitions'].default})")


def add_stream_options(command: argparse.ArgumentParser) -> None:
    """Add the projection, ``--root`` and where the events are (``--nats-url``, ``--stream``, ``--subject-prefix``)."""
    command.add_argument("projection", metavar="module:Projection")
    command.add_argument("--root", required=True, help="folder of the Delta tables (<root>/<table>)")
    command.add_argument("--nats-url", help="NATS server URL(s) (NATS_URL)")
    command.add_argument("--stream", help="JetStream stream of the events (JETSOURCING_STREAM)")
    command.add_argument("--subject-prefix", help="subject prefix of the events (JETSOURCING_SUBJECT_PREFIX)")


def event_store_settings(args: argparse.Namespace) -> EventStoreSettings:
    """The event store settings of :func:`add_stream_options`' arguments, then ``NATS_URL`` / ``JETSOURCING_*``."""
    overrides = {k: v for k, v in (("nats_url", args.nats_url), ("stream", args.stream),
                                   ("subject_prefix", args.subject_prefix)) if v}
    return EventStoreSettings(**overrides)


def stage_printer() -> Callable[[str], None]:
    """A progress callback printing each line with the seconds since it was made."""
    started = time.monotonic()

    def stage(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {text}", flush=True)

    return stage


def start_spark(
    args: argparse.Namespace, settings: EventStoreSettings, stage: Callable[[str], None], signals: ExitOnSignal
) -> tuple[SparkSession, SparkSettings]:
    """Check the settings and the server, then start the session of :func:`spark_settings`, saying so."""
    wanted = spark_settings(args)  # a bad JETSOURCING_SPARK_* fails before anything else
    stage(f"the stream's last position: {last_position(settings):,}")  # a bad server fails before Spark starts
    stage("starting Spark with Delta Lake (its start-up output goes to a log file)")
    spark = new_session(wanted, signals)
    stage(f"Spark {spark.version} started: master {spark.sparkContext.master}, "
          f"{spark.conf.get('spark.sql.shuffle.partitions')} shuffle partitions")
    return spark, wanted


def new_session(settings: SparkSettings, signals: ExitOnSignal) -> SparkSession:
    """:func:`~spark_projections.session.spark_session` of ``settings``, the command's ``signals`` handlers kept (the
    context PySpark starts installs its own for Ctrl-C)."""
    from spark_projections.session import spark_session  # here: `--help` stays instant and never touches Spark

    try:
        return spark_session(settings)
    finally:
        signals.arm()


def _master(text: str) -> str:
    try:
        return check_master(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def spark_settings(args: argparse.Namespace) -> SparkSettings:
    """``SparkSettings`` from ``JETSOURCING_SPARK_*``, with the ``--master`` and ``--shuffle-partitions`` of
    ``args`` (:func:`add_common_options`) winning over them. Raises :class:`SparkUsageError` naming the
    variable whose value is invalid."""
    overrides = {k: v for k, v in (("master", args.master), ("shuffle_partitions", args.shuffle_partitions))
                 if v is not None}
    return _from_environment(**overrides)


def _from_environment(**overrides: Any) -> SparkSettings:
    try:
        return SparkSettings(**overrides)
    except ValidationError as exc:  # argparse checked the overrides: the environment is wrong
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "?"
        reason = first.get("ctx", {}).get("error", first["msg"])
        raise SparkUsageError(
            f"JETSOURCING_SPARK_{field.upper()}={first['input']!r} is not valid: {reason}"
        ) from exc


def run_command(args: argparse.Namespace, spark: SparkSession | None = None,
                signals: ExitOnSignal | None = None) -> int:
    """Run a parsed ``rebuild`` / ``update`` command: a line per stage as it starts (with the seconds since the
    command began), then the result and, per table, its Delta version and the rows the commit wrote.

    Uses ``spark`` as it is, or starts a session from :func:`spark_settings` (keeping ``signals``' handlers); the
    event store settings come from the arguments, then ``NATS_URL`` / ``JETSOURCING_*``.
    """
    stage = stage_printer()
    projection = load(args.projection)
    settings = event_store_settings(args)
    if spark is None:
        spark, _ = start_spark(args, settings, stage, signals or ExitOnSignal(""))
    run = (rebuild if args.command == "rebuild" else update)(
        spark, projection, settings, args.root, partitions=args.partitions, to_position=args.to_position,
        error_policy=args.error_policy, progress=stage,
    )
    folded = "" if run.events is None else f", {run.events:,} events folded"
    stage(f"{run.projection}: {run.mode}, positions {run.from_position:,} to {run.position:,}{folded} "
          f"(app id {run.app_id})")
    for name, result in run.tables.items():
        state = "committed" if result.applied else "already recorded"
        print(f"  {name}: {state}, table version {result.table_version}{_rows_written(spark, args.root, name, result)}")
    return 0


def _rows_written(spark: SparkSession, root: str, name: str, result: WriteResult) -> str:
    """``, N rows written`` (or inserted, updated, deleted) by the commit ``result`` made, from Delta's metrics."""
    if not result.applied:
        return ""
    # The commit just made is the newest one, unless another writer committed since (then no figures).
    entry = next((e for e in table_history(spark, Path(root) / name, limit=1) if e.version == result.table_version), None)
    metrics = entry.metrics if entry is not None else {}
    if "numOutputRows" in metrics and entry is not None and entry.operation != "MERGE":
        return f", {int(metrics['numOutputRows']):,} rows written"
    counts = [(metrics.get(f"numTargetRows{kind}"), kind.lower()) for kind in ("Inserted", "Updated", "Deleted")]
    shown = [f"{int(n):,} {kind}" for n, kind in counts if n is not None]
    return f", rows {', '.join(shown)}" if shown else ""


def _check(signals: ExitOnSignal) -> int:
    # Imported here so `--help` stays instant and never touches Spark.
    from spark_projections.delta import full_rebuild
    from spark_projections.jars import delta_coordinate, session_jars
    from spark_projections.java import check_java

    settings = _from_environment()
    java = check_java()
    started = time.monotonic()
    spark = new_session(settings, signals)
    elapsed = time.monotonic() - started
    round_trip = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="jetsourcing-check-") as tmp:
        table = Path(tmp) / "check"
        frame = spark.createDataFrame([(1, "ok")], "id BIGINT, status STRING")
        written = full_rebuild(frame, table, app_id="jetsourcing-check", position=1)
        rows = spark.read.format("delta").load(str(table)).collect()
    jars = spark.sparkContext.getConf().get("spark.jars") or ""
    print(f"java: {java.version} ({java.executable})")
    print(f"spark: {spark.version} master={spark.sparkContext.master}")
    packages = spark.sparkContext.getConf().get("spark.jars.packages")
    if settings.delta_jars_dir is not None:
        print(f"delta jars: offline from {settings.delta_jars_dir}")
    elif packages:
        print(f"delta jars: {packages} (Maven, through Ivy)")
    else:
        folders = sorted({str(jar.parent) for jar in session_jars(spark)})
        print(f"delta jars: {delta_coordinate(settings.delta_version)} (from the jars cache: {', '.join(folders)})")
    print(f"classpath jars: {len([j for j in jars.split(',') if j])}")
    print(f"session start: {elapsed:.1f}s")
    ok = [tuple(r) for r in rows] == [(1, "ok")] and written.applied
    print(f"delta round trip (write a table, read it back): {'ok' if ok else 'FAILED'} "
          f"in {time.monotonic() - round_trip:.1f}s")
    return 0 if ok else 1


def _fetch(dest: Path, delta_version: str | None, signals: ExitOnSignal) -> int:
    from spark_projections.jars import export_delta_jars, offline_delta_jars

    settings = _from_environment()
    # Never from an offline folder, whatever the environment says: from the jars cache or Maven.
    update: dict[str, object] = {"delta_jars_dir": None}
    if delta_version:
        update["delta_version"] = delta_version
    spark = new_session(settings.model_copy(update=update), signals)
    copied = export_delta_jars(spark, dest)
    offline_delta_jars(dest)  # prove the folder is usable before saying so
    print(f"copied {len(copied)} jars into {dest}")
    print(f"use them with: JETSOURCING_SPARK_DELTA_JARS_DIR={dest.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

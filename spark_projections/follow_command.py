"""``jetsourcing spark follow`` and ``jetsourcing spark status``: a projection followed by a streaming query, and
where it is.

``follow`` prints a line per micro-batch (events, positions, seconds) and stops
after the micro-batch in flight on SIGTERM or Ctrl-C (waiting ``--grace-s`` at
most: a batch cut short is redone whole by the next run, exactly once). A NATS
outage is waited out for ``JETSOURCING_OUTAGE_LIMIT_S`` (default: for ever), a
line on stderr when it starts and when it ends. Exit status 0 when caught up
(``--available-now``) or stopped by SIGTERM, its normal stop; 130 when stopped by
Ctrl-C; 1 when the query fails, its last line the cause in one paragraph (a
handler error under ``stop`` names the event; a NATS outage past the limit names
the server), without Spark's stack traces (``--log-level DEBUG`` keeps them).
``status`` reads what the follower last wrote and asks the server for the
stream's last position; it starts no Spark.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from py4j.protocol import Py4JError
from pyspark.sql import SparkSession

from eventstore.exit_codes import INTERRUPTED, SUCCESS, add_exit_codes
from spark_projections.cli import (
    add_common_options,
    add_stream_options,
    at_least_one,
    event_store_settings,
    load,
    stage_printer,
    start_spark,
)
from spark_projections.errors import SparkProjectionError
from spark_projections.follow import follow, follow_status, status_path
from spark_projections.interrupt import ExitOnSignal
from spark_projections.projection import last_position
from spark_projections.settings import SparkSettings

__all__ = ["add_follow_commands", "run_follow", "run_status"]


def add_follow_commands(commands: Any) -> None:
    """Add ``follow`` and ``status`` to an argparse sub-parsers object."""
    command = commands.add_parser(
        "follow", help="keep a projection's Delta tables up to date with a streaming query (until SIGTERM)",
        epilog="example: jetsourcing spark follow myapp.views:AccountBalances --root /lake/accounts --trigger-s 1",
    )
    add_exit_codes(command, runs_until_stopped=True)
    add_common_options(command)
    defaults = SparkSettings.model_fields
    command.add_argument("--checkpoint", help="Spark checkpoint folder (default: <root>/_jetsourcing/checkpoints/"
                         "<name>.v<version>)")
    command.add_argument("--trigger-s", type=_positive_seconds, metavar="SECONDS",
                         help="seconds between micro-batches (JETSOURCING_SPARK_TRIGGER_S; default "
                         f"{defaults['trigger_s'].default})")
    command.add_argument("--max-events-per-trigger", type=at_least_one, metavar="N",
                         help="stream positions per micro-batch at most (JETSOURCING_SPARK_MAX_EVENTS_PER_TRIGGER; "
                         f"default {defaults['max_events_per_trigger'].default:,})")
    command.add_argument("--available-now", action="store_true", help="read what the stream holds now, then exit")
    command.add_argument("--grace-s", type=_positive_seconds, default=10.0, metavar="SECONDS",
                         help="on SIGTERM, how long to wait for the micro-batch in flight (default 10)")
    status = commands.add_parser(
        "status", help="where a followed projection is: its last micro-batch and the lag behind the stream",
        epilog="example: jetsourcing spark status myapp.views:AccountBalances --root /lake/accounts",
    )
    add_exit_codes(status)
    add_stream_options(status)
    status.add_argument("--json", action="store_true", help="one JSON object instead of text")


def run_follow(args: argparse.Namespace, spark: SparkSession | None = None,
               signals: ExitOnSignal | None = None) -> int:
    """Run a parsed ``follow``: start the query, report each micro-batch, stop on SIGTERM/SIGINT after the batch in
    flight (exit status 0 after SIGTERM, 130 after Ctrl-C). Uses ``spark`` as it is, or starts a session as
    ``rebuild`` does."""
    stage = stage_printer()
    projection = load(args.projection)
    settings = event_store_settings(args)
    if spark is None:
        spark, spark_settings = start_spark(args, settings, stage, signals or ExitOnSignal(""))
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            _report_failures_once(spark)
    else:
        spark_settings = SparkSettings()
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        follower = follow(
            spark, projection, settings, args.root, checkpoint=args.checkpoint,
            trigger_s=args.trigger_s or spark_settings.trigger_s,
            max_events_per_trigger=args.max_events_per_trigger or spark_settings.max_events_per_trigger,
            partitions=args.partitions, error_policy=args.error_policy, available_now=args.available_now,
            progress=stage,
        )
        stage(f"following {args.projection} into {args.root} (query {follower.query.name}); "
              f"{'catching up, then exiting' if args.available_now else 'SIGTERM or Ctrl-C stops it'}")
        while follower.active and not stop.wait(0.5):
            pass
        if stop.is_set() and follower.active:
            stage(f"stopping after the micro-batch in flight (at most {args.grace_s:g}s)")
            follower.stop(args.grace_s)
            stage("stopped")
            return INTERRUPTED if received[0] == signal.SIGINT else SUCCESS
        failure = follower.failure
        if failure is not None:
            raise SparkProjectionError(f"the streaming query failed: {failure}")
        stage("caught up" if args.available_now else "the query ended")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_status(args: argparse.Namespace) -> int:
    """Print what the follower of ``args.projection`` under ``args.root`` last did, and its lag behind the stream."""
    projection = load(args.projection)
    status = follow_status(args.root, projection)
    last = last_position(event_store_settings(args))
    if args.json:
        print(json.dumps({"status": None if status is None else status.__dict__, "stream_last_position": last}))
        return 0
    if status is None:
        print(f"{projection.name}: no follower has written {status_path(args.root, projection)} yet; the stream's "
              f"last position is {last:,}")
        return 0
    progress = status.last_progress or {}
    rates = ""
    if progress:
        rates = (f"; Spark: {progress.get('inputRowsPerSecond', 0):,.0f} rows/s in, "
                 f"{progress.get('processedRowsPerSecond', 0):,.0f} rows/s processed")
    ago = time.time() - status.at
    print(f"{projection.name} ({status.app_id}): micro-batch {status.batch_id} {status.mode}, "
          f"{status.positions:,} positions in {status.seconds:.1f}s, {ago:,.0f}s ago")
    print(f"  read to position {status.position:,}, tables at {status.tables_position:,}; the stream's last "
          f"position is {last:,} (up to {max(0, last - status.position):,} positions behind){rates}")
    return 0


# Who reports a failed query besides us, each with the JVM's and the Python worker's stack traces (400 lines and
# more): the task, the task set, the query's end, and py4j's callback server for the foreachBatch function.
_FAILURE_REPORTERS = (
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSetManager",
    "org.apache.spark.sql.execution.streaming.MicroBatchExecution",  # Spark 4.0, 4.1
    "org.apache.spark.sql.execution.streaming.runtime.MicroBatchExecution",  # Spark 4.2
)


def _report_failures_once(spark: SparkSession) -> None:
    """Leave the failure to the command's last line (:func:`~spark_projections.errors.root_cause`): Spark's and
    py4j's reports of it bury the cause in stack traces. ``--log-level DEBUG`` keeps them."""
    logging.getLogger("py4j").setLevel(logging.CRITICAL)
    try:
        jvm: Any = spark.sparkContext._jvm
        fatal = jvm.org.apache.logging.log4j.Level.FATAL
        for name in _FAILURE_REPORTERS:
            jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, fatal)
    except Py4JError:  # another logging backend: the traces stay, the last line still names the cause
        pass


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value

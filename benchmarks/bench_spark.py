"""Spark benchmark: a full rebuild of a Delta read model from JetStream, against the same from Parquet.

For N events (default 1,000,000; single-event commits on 10,000 accounts), in one run:

* ``jetstream_to_delta_eps_p1`` / ``_p2``: :func:`spark_projections.projection.rebuild` of a
  DataFrame projection (balance, movements, owner and last position per account; payload
  JSON parsed with ``from_json``) straight from JetStream with 1 and 2 read partitions;
* ``parquet_to_delta_eps``: the same events from a Parquet copy, the same projection, the
  same Delta write (:func:`spark_projections.delta.full_rebuild`): the Spark-side ceiling;
* ``jetstream_read_eps_p1`` / ``_p2``: the data source alone, every column (``noop`` sink),
  and ``jetstream_read_eps_p2_rows`` the same with one Python tuple per event instead of
  Arrow batches - the alternative the source does not take;
* ``arrow_source_to_delta_eps``: the same rebuild from a Python data source that reads the
  Parquet copy with pyarrow in its workers: what Spark's Python Data Source API costs by
  itself, i.e. the ceiling for any Python reader;
* ``cpu_us_per_event``: where the CPU of the best p2 and Parquet runs went, in microseconds
  per event: the nats-server, the Spark JVM and the Python workers (the reader), from
  ``/proc``. All of them share the machine's cores, so the p2 rate is bounded by
  ``cores / (server + jvm + python)``; ``reader_budget_us`` is the Python CPU per event the
  0.5 target leaves once the measured server and JVM costs are paid;
* ``update_1pct_over_rebuild``: an :func:`~spark_projections.projection.update` that
  brings a fold projection (the same balances, written by the daemon's handlers, folded per
  account) over 1% new events, against a full rebuild of it, the median of the rounds' ratios
  (each round rebuilds, then updates what it rebuilt); ``update_1pct_over_rebuild_dataframe``
  the same for the DataFrame projection (its p2 rebuild, then an update that combines the new
  rows into the stored ones); ``update_1pct_s`` their median seconds. The new events come
  after the N of the other figures (which read positions 1 to N only) and touch every account
  once, so an update rewrites every row of the 10,000 (the fold's 1% update stops one event
  short, and ``update_one_event_over_rebuild`` times the update of that last event: what an
  update costs whatever it holds);
* ``stream_catchup_eps``: a follower (:func:`~spark_projections.follow.follow`, the DataFrame
  projection, ``Trigger.AvailableNow``) started on an empty root catches up on the whole
  stream (N + 1% events), timed from its first micro-batch's start to its last one's end as
  Spark reports them; ``stream_catchup_over_rebuild`` that rate over the p2 rebuild's;
  ``stream_start_s`` the median time from ``follow()`` to the first micro-batch (a query's
  start: planning, the Python process its source plans in), and ``stream_catchup_wall_eps`` /
  ``stream_catchup_wall_over_rebuild`` the rate with the start included;
* ``stream_latency_p50_s`` / ``_p99_s``: single appends at random intervals, each timed until
  a running follower with a 1 s trigger has written the micro-batch that holds it to Delta
  (``--latency-samples`` of them); ``stream_batch_s_last`` the last such batch's seconds;
  ``delta_merge_floor_s``: one Delta MERGE of a single row into a small table in the same
  session, the floor under every micro-batch.

Each rate is the best of ``--rounds`` runs (default 3) after one warm-up run; the rounds
take turns over the figures, so the JVM's warm-up and the shared machine's busy spells
favour none of them.
Own embedded nats-server and Spark session (``local[2]``); progress on stderr; the last
stdout line is one JSON object.

Run: ``.venv/bin/python benchmarks/bench_spark.py`` (``--events 100000`` for a quick run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.sql import DataFrame  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition  # noqa: E402
from pyspark.sql.types import StructType  # noqa: E402

from eventstore import EmbeddedServer, EventStore, EventStoreSettings, RecordedEvent, StreamId, encode_commit  # noqa: E402
from eventstore.jetstream import Commits  # noqa: E402
from eventstore.connection import connect  # noqa: E402
from projections import Projection, Table, Transaction, handles  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from spark_projections.delta import full_rebuild, incremental_merge  # noqa: E402
from spark_projections.follow import Follower, follow  # noqa: E402
from spark_projections.projection import GROUP_COLUMN, Combine, DataFrameProjection, rebuild, update  # noqa: E402
from spark_projections.session import SparkSettings, spark_session  # noqa: E402

from proc_cpu import cpu_seconds  # noqa: E402  (this script's folder is on sys.path)
from spark_projections import _batches, _options, _range_reader, source  # noqa: E402
from spark_projections.source import JetStreamDataSource, read_events  # noqa: E402

ACCOUNTS = 10_000
PAYLOAD = "amount BIGINT, owner STRING"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def fill(url: str, settings: EventStoreSettings, total: int, start: int = 0) -> float:
    """``total`` single-event commits in the event store's wire format, pipelined; returns events/s.

    Event ``n`` (from ``start``) goes to account ``n % ACCOUNTS``, so a second call goes on
    where the first stopped. Raw publishes with a reply inbox (the stream's acknowledgements
    are counted, at most ``window`` outstanding): the same bytes ``EventStore.append``
    writes, without its per-append version checks, so filling takes seconds rather than
    minutes.
    """
    store = await EventStore.connect(settings)  # creates the stream with the event store's config
    await store.close()
    nc = await connect([url])
    inbox = nc.new_inbox()
    acked = 0
    errors: list[bytes] = []
    room = asyncio.Event()
    window = 20_000

    async def on_ack(msg: object) -> None:
        nonlocal acked
        acked += 1
        data = getattr(msg, "data", b"")
        if b"error" in data:
            errors.append(data)
        if acked % 2000 == 0:
            room.set()

    await nc.subscribe(f"{inbox}.*", cb=on_ack, pending_msgs_limit=-1, pending_bytes_limit=-1)
    started = time.perf_counter()
    for n in range(start, start + total):
        account = n % ACCOUNTS
        version = n // ACCOUNTS + 1
        if version == 1:
            kind, payload = "AccountOpened", f'{{"owner":"owner-{n % 97}"}}'
        elif n % 3 == 0:
            kind, payload = "Withdrawn", f'{{"amount":{n % 500}}}'
        else:
            kind, payload = "Deposited", f'{{"amount":{n % 1000}}}'
        headers, body = encode_commit(
            msg_id=uuid.uuid4().hex, types=[kind], schema_versions=[1], event_ids=[uuid.uuid4().hex],
            payloads=[payload.encode()], last_version=version, recorded_at="2026-01-01T00:00:00.000000+00:00",
        )
        await nc.publish(f"{settings.subject_prefix}.Account.acc-{account:05d}", body, reply=f"{inbox}.a",
                         headers=headers)
        while n + 1 - start - acked > window:
            room.clear()
            await nc.flush()
            await asyncio.wait_for(room.wait(), 30)
        if (n - start) % 100_000 == 99_999:
            log(f"fill: {n - start + 1:,} events")
    while acked < total:
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - started
    await nc.close()
    if errors:
        raise RuntimeError(f"the stream refused {len(errors)} publishes, e.g. {errors[0]!r}")
    return total / elapsed


def balances(events: DataFrame) -> DataFrame:
    """Balance, movement count, owner and last position per account, in one pass over the events."""
    amount = F.col("data.amount")
    return (
        events.select("entity_id", "type", "position", F.from_json("payload", PAYLOAD, {"mode": "FAILFAST"}).alias("data"))
        .groupBy(F.col("entity_id").alias("account_id"))
        .agg(
            F.sum(F.when(F.col("type") == "Deposited", amount).when(F.col("type") == "Withdrawn", -amount)
                  .otherwise(0)).alias("balance"),
            F.sum(F.when(F.col("type").isin("Deposited", "Withdrawn"), 1).otherwise(0)).alias("movements"),
            F.max(F.when(F.col("type") == "AccountOpened", F.col("data.owner"))).alias("owner"),
            F.max("position").alias("last_position"),
        )
    )


COMBINE: dict[str, Combine] = {"balance": "sum", "movements": "sum", "owner": "first", "last_position": "max"}
"""How an update merges new ``balances`` rows into the stored ones."""


class FoldBalances(Projection):
    """The rows of ``balances``, written by the daemon's handlers (folded per account in Spark)."""

    name = "fold_balances"
    categories = ("Account",)
    tables = (Table("balances", key="account_id", columns={
        "account_id": str, "balance": int, "movements": int, "owner": str, "last_position": int}),)

    @handles("AccountOpened")
    def opened(self, event: RecordedEvent, tx: Transaction) -> None:
        tx.upsert("balances", event.stream_id.entity_id, {
            "balance": 0, "movements": 0, "owner": json.loads(event.payload)["owner"], "last_position": event.position,
        })

    @handles("Deposited", "Withdrawn")
    def moved(self, event: RecordedEvent, tx: Transaction) -> None:
        row = tx.get("balances", event.stream_id.entity_id)
        if row is None:
            return
        amount = json.loads(event.payload)["amount"]
        row["balance"] += amount if event.type == "Deposited" else -amount
        row["movements"] += 1
        row["last_position"] = event.position
        tx.upsert("balances", event.stream_id.entity_id, row)


class RowsDataSource(JetStreamDataSource):
    """The jetstream source yielding one Python tuple per event instead of Arrow batches (for comparison).

    Same wire-level reader; per event a header regex, a dict and a tuple, converted to Arrow
    by PySpark. Defined in ``__main__``, so Spark ships it to the workers by value.
    """

    @classmethod
    def name(cls) -> str:
        return "jetstream_rows"

    def reader(self, schema: StructType) -> DataSourceReader:
        class RowsReader(source._Reader):
            def read(self, partition: InputPartition) -> Iterator[tuple[object, ...]]:
                if not isinstance(partition, source._Range):
                    return iter(())
                return read_rows(self.options, partition.start, partition.stop)

        return RowsReader(_options.Options.parse(self.options))


def read_rows(opts: Any, start: int, stop: int) -> Iterator[tuple[object, ...]]:
    headers_re = re.compile(rb"\r\n(Es-[A-Za-z-]+):[ \t]*([^\r]*)")
    skip = len(opts.subject_prefix) + 1
    streams: dict[bytes, tuple[str, str, str]] = {}
    for parts in _range_reader.range_parts(opts, start, stop, native=False):  # framed in Python: rows of bytes
        rows = [row for part in parts if isinstance(part, Commits)
                for row in zip(part.positions, part.subjects, part.headers, part.bodies)]
        for seq, subject, raw, body in rows:
            h = dict(headers_re.findall(raw))
            stream = streams.get(subject)
            if stream is None:
                category, _, entity = subject[skip:].decode().partition(".")
                stream = streams[subject] = (f"{category}/{unquote(entity)}", category, unquote(entity))
            corr, cause = h.get(b"Es-Correlation-Id"), h.get(b"Es-Causation-Id")
            yield (seq, 0, *stream, int(h[b"Es-Version"]), h[b"Es-Type"].decode(),
                   int(h[b"Es-Schema-Version"]), h[b"Es-Event-Id"].decode(), corr and corr.decode(),
                   cause and cause.decode(), datetime.fromisoformat(h[b"Es-Recorded-At"].decode()), body.decode())


class ArrowFileSource(DataSource):
    """A Python data source serving the Parquet copy's event columns (pyarrow in the workers).

    The same Spark side as the jetstream source (Python workers yielding Arrow batches of
    5,000 rows), with reading reduced to a local Parquet scan: the ceiling of the API.
    """

    @classmethod
    def name(cls) -> str:
        return "arrowfile"

    def schema(self) -> str:
        return "position BIGINT, type STRING, entity_id STRING, payload STRING"

    def reader(self, schema: StructType) -> DataSourceReader:
        return ArrowFileReader(str(self.options["path"]), int(self.options.get("partitions", 2)))


class ArrowFileReader(DataSourceReader):
    def __init__(self, path: str, parts: int) -> None:
        self.path = path
        self.parts = parts

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(i) for i in range(self.parts)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(self.path, columns=["position", "type", "entity_id", "payload"])
        low, high = (table.num_rows * k // self.parts for k in (partition.value, partition.value + 1))
        schema = pa.schema([("position", pa.int64()), ("type", pa.string()), ("entity_id", pa.string()),
                            ("payload", pa.string())])
        for batch in table.slice(low, high - low).to_batches(max_chunksize=5000):
            yield pa.RecordBatch.from_arrays(batch.columns, schema=schema)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Spark's Python workers and their daemon)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


class CpuMeter:
    """CPU used by the nats-server, the Spark JVM and Spark's Python workers during one run."""

    def __init__(self, server_pid: int, jvm_pid: int) -> None:
        self.server_pid = server_pid
        self.jvm_pid = jvm_pid

    def sample(self) -> dict[str, float]:
        workers = descendants(self.jvm_pid)
        return {
            "nats_server": cpu_seconds(self.server_pid),
            "spark_jvm": cpu_seconds(self.jvm_pid),
            "python_workers": sum(cpu_seconds(p, children=True) for p in workers),
        }


class Run:
    """Every timed run of one figure (seconds, in round order), and the rate and CPU breakdown of the best."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.rate = 0.0
        self.cpu_us: dict[str, float] = {}


def interleaved(rounds: int, figures: list[tuple[str, str, Callable[[int], None], int]], meter: CpuMeter) -> dict[str, Run]:
    """``rounds`` timed runs of every figure (key, label, run, events it handles), taken in turns.

    Taking turns (round 1 of each, then round 2, ...) gives every figure the same share of
    the JVM's warm-up and of the machine's quiet and busy spells, which measuring one figure
    after the other does not.
    """
    runs: dict[str, Run] = {key: Run() for key, _, _, _ in figures}
    for i in range(rounds):
        for key, label, run, events in figures:
            before = meter.sample()
            started = time.perf_counter()
            run(i)
            elapsed = time.perf_counter() - started
            after = meter.sample()
            cpu_us = {k: round(1e6 * (after[k] - before[k]) / events, 2) for k in after}
            log(f"round {i + 1}, {label}: {elapsed:.2f}s = {events / elapsed:,.0f} events/s; CPU us/event {cpu_us}")
            figure = runs[key]
            figure.seconds.append(elapsed)
            if events / elapsed > figure.rate:
                figure.rate, figure.cpu_us = events / elapsed, cpu_us
    return runs


class Deposited(BaseModel):
    amount: int


async def stream_latencies(settings: EventStoreSettings, follower: Follower, count: int) -> list[float]:
    """Seconds from each of ``count`` appends (one event, at random intervals) until ``follower`` has read it: its
    micro-batch is committed to Delta by then. Appends keep coming while earlier ones are in flight."""
    import random

    pending: dict[int, float] = {}
    seen: list[float] = []

    async def watch() -> None:
        while True:
            status = follower.status
            reached = status.position if status is not None else 0
            now = time.perf_counter()
            for position in [p for p in pending if p <= reached]:
                seen.append(now - pending.pop(position))
            await asyncio.sleep(0.01)

    async with EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        watcher = asyncio.create_task(watch())
        try:
            for n in range(count):
                appended = await store.append(StreamId("Account", f"late-{n:05d}"), [Deposited(amount=n)])
                pending[appended.position] = time.perf_counter()
                await asyncio.sleep(random.uniform(0.2, 1.0))
            deadline = time.perf_counter() + 120
            while pending and time.perf_counter() < deadline:
                await asyncio.sleep(0.05)
            if pending:
                raise RuntimeError(f"the follower did not read positions {sorted(pending)[:5]} within 120 s")
        finally:
            watcher.cancel()
    return seen


def trigger_span(follower: Follower) -> tuple[float, float]:
    """When (Unix time) the query's first micro-batch started and its last one ended, from Spark's progress."""
    progress = [json.loads(p.json) for p in follower.query.recentProgress]
    starts = [datetime.fromisoformat(p["timestamp"]).timestamp() for p in progress]
    return starts[0], starts[-1] + progress[-1]["durationMs"]["triggerExecution"] / 1000


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def median_ratio(numerator: Run, denominator: Run) -> float:
    """The median over the rounds of one figure's time over another's in the same round."""
    return round(statistics.median(a / b for a, b in zip(numerator.seconds, denominator.seconds)), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--latency-samples", type=int, default=60, help="appends timed until a follower reads them")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measured runs per figure, taken in turns (the best rate, the median update ratio)")
    args = parser.parse_args()
    total = args.events
    new = max(total // 100, 1)
    last = total + new
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp, EmbeddedServer(Path(tmp) / "nats") as server:
        settings = EventStoreSettings(nats_url=server.url, stream="BENCH", subject_prefix="bench")
        fill_eps = asyncio.run(fill(server.url, settings, total))
        log(f"fill: {total:,} events at {fill_eps:,.0f} events/s")
        asyncio.run(fill(server.url, settings, new, start=total))  # what the updates read

        started = time.perf_counter()
        spark = spark_session(SparkSettings(
            master="local[2]", app_name="bench-spark", shuffle_partitions=2, driver_memory="4g",
            extra_conf={"spark.ui.showConsoleProgress": "false", "spark.sql.session.timeZone": "UTC"},
        ))
        log(f"spark session: {time.perf_counter() - started:.1f}s")
        # The projection names the event columns it reads, so the source builds only those
        # (Spark prunes Parquet columns by itself, but cannot tell a Python source).
        columns = ("position", "type", "entity_id", "payload")
        projection = DataFrameProjection(name="balances", build=balances, keys=("account_id",),
                                         categories=("Account",), columns=columns, combine=COMBINE)
        fold = FoldBalances()
        root = Path(tmp) / "delta"

        # The Parquet copy, written from JetStream (this also warms up the Python workers).
        parquet = str(Path(tmp) / "events.parquet")
        read_events(spark, settings, to_position=total, partitions=2).write.parquet(parquet)
        log("parquet copy written")

        def from_parquet(i: int) -> None:
            full_rebuild(balances(spark.read.parquet(parquet)), root / f"parquet-{i}", app_id="balances.v1",
                         position=total)

        def from_jetstream(partitions: int) -> Callable[[int], None]:
            def run(i: int) -> None:
                result = rebuild(spark, projection, settings, root / f"js-p{partitions}-{i}", partitions=partitions,
                                 to_position=total)
                assert result.position == total and result.tables["balances"].applied

            return run

        def dataframe_update(i: int) -> None:  # the p2 rebuild of the same round, brought to `last`
            result = update(spark, projection, settings, root / f"js-p2-{i}", to_position=last)
            assert result.mode == "merge" and result.tables["balances"].applied

        def fold_rebuild(i: int) -> None:
            result = rebuild(spark, fold, settings, root / f"fold-{i}", to_position=total)
            assert result.position == total and result.tables["balances"].applied

        def fold_update(i: int) -> None:  # the fold rebuild of the same round, brought to `last - 1`
            result = update(spark, fold, settings, root / f"fold-{i}", to_position=last - 1)
            assert (result.mode, result.events) == ("merge", new - 1)

        def fold_update_one(i: int) -> None:  # ... then to `last`: an update of one new event
            result = update(spark, fold, settings, root / f"fold-{i}", to_position=last)
            assert (result.mode, result.events) == ("merge", 1)

        catchup_starts: list[float] = []  # follow() called -> its first micro-batch starts
        catchup_batches: list[float] = []  # the first micro-batch starts -> the last one ends

        def stream_catchup(i: int) -> None:  # a follower started on an empty root reads the whole stream
            called = time.time()
            follower = follow(spark, projection, settings, root / f"follow-{i}", available_now=True, partitions=2)
            assert follower.await_termination(3600) and follower.error is None, follower.error
            assert follower.status is not None and follower.status.position == last, follower.status
            first, end = trigger_span(follower)
            catchup_starts.append(first - called)
            catchup_batches.append(end - first)

        def read_only(partitions: int) -> Callable[[int], None]:
            def run(i: int) -> None:
                read_events(spark, settings, to_position=total, partitions=partitions).write.format("noop").mode(
                    "overwrite").save()

            return run

        spark.dataSource.register(ArrowFileSource)

        def from_arrow_source(i: int) -> None:
            events = spark.read.format("arrowfile").option("path", parquet).option("partitions", 2).load()
            full_rebuild(balances(events), root / f"arrow-{i}", app_id="balances.v1", position=total)

        # Warm-up: JIT, Python workers, Delta classes.
        from_parquet(99)
        from_jetstream(2)(99)
        dataframe_update(99)
        from_arrow_source(99)
        fold_rebuild(99)
        fold_update(99)
        fold_update_one(99)
        jvm = spark.sparkContext._gateway.proc.pid  # type: ignore[union-attr] # spark-submit execs the JVM
        assert server.pid is not None
        meter = CpuMeter(server.pid, jvm)
        spark.dataSource.register(RowsDataSource)

        def read_rows_only(i: int) -> None:
            (spark.read.format("jetstream_rows").option("url", server.url).option("stream", "BENCH")
             .option("subject_prefix", "bench").option("to_position", total).option("partitions", 2).load()
             .write.format("noop").mode("overwrite").save())

        runs = interleaved(args.rounds, [
            ("parquet_to_delta_eps", "parquet -> delta", from_parquet, total),
            ("jetstream_to_delta_eps_p1", "jetstream p1 -> delta", from_jetstream(1), total),
            ("jetstream_to_delta_eps_p2", "jetstream p2 -> delta", from_jetstream(2), total),
            ("dataframe_update", f"update of {new:,} new events, dataframe projection", dataframe_update, new),
            ("arrow_source_to_delta_eps", "python arrow source -> delta", from_arrow_source, total),
            ("jetstream_read_eps_p1", "jetstream p1 read", read_only(1), total),
            ("jetstream_read_eps_p2", "jetstream p2 read", read_only(2), total),
            ("jetstream_read_eps_p2_rows", "jetstream p2 read, row tuples", read_rows_only, total),
            ("fold_rebuild_eps", "fold projection rebuild", fold_rebuild, total),
            ("fold_update", f"update of {new - 1:,} new events, fold projection", fold_update, new - 1),
            ("fold_update_one", "update of one new event, fold projection", fold_update_one, 1),
            ("stream_catchup_eps", "follow: a streaming query catching up", stream_catchup, last),
        ], meter)
        result: dict[str, object] = {"bench": "spark", "events": total, "fill_eps": round(fill_eps)}
        result.update({key: round(run.rate) for key, run in runs.items() if "_update" not in key})
        p2, ceiling = runs["jetstream_to_delta_eps_p2"], runs["parquet_to_delta_eps"]
        result["p2_vs_parquet"] = round(p2.rate / ceiling.rate, 3)
        result["arrow_source_vs_parquet"] = round(runs["arrow_source_to_delta_eps"].rate / ceiling.rate, 3)
        result["cpu_us_per_event"] = {"jetstream_p2": p2.cpu_us, "parquet": ceiling.cpu_us,
                                      "arrow_source": runs["arrow_source_to_delta_eps"].cpu_us}
        # At half the Parquet rate, a 2-core machine has 2 * 2 / parquet_eps seconds of CPU per
        # event; what the server and the JVM measurably take of it is not left for the reader.
        cores = os.cpu_count() or 1
        result["reader_budget_us"] = round(
            cores * 2e6 / ceiling.rate - p2.cpu_us["nats_server"] - p2.cpu_us["spark_jvm"], 2
        )
        fold_rebuilds, fold_updates, dataframe_updates = runs["fold_rebuild_eps"], runs["fold_update"], runs["dataframe_update"]
        result["update_1pct_over_rebuild"] = median_ratio(fold_updates, fold_rebuilds)
        # What an update costs whatever it holds: the floor under update_1pct_over_rebuild.
        result["update_one_event_over_rebuild"] = median_ratio(runs["fold_update_one"], fold_rebuilds)
        result["update_1pct_over_rebuild_dataframe"] = median_ratio(dataframe_updates, p2)
        result["update_1pct_s"] = {
            name: {"update": round(statistics.median(u.seconds), 2), "rebuild": round(statistics.median(r.seconds), 2)}
            for name, u, r in (("fold", fold_updates, fold_rebuilds), ("fold_one_event", runs["fold_update_one"],
                               fold_rebuilds), ("dataframe", dataframe_updates, p2))
        }

        # The query's own catch-up rate (its micro-batches, as Spark times them), and the start of a
        # query apart: planning, and the Python process the source's planning runs in.
        wall = runs["stream_catchup_eps"]
        result["stream_catchup_eps"] = round(last / min(catchup_batches))
        result["stream_catchup_over_rebuild"] = round(last / min(catchup_batches) / p2.rate, 3)
        result["stream_start_s"] = round(statistics.median(catchup_starts), 2)
        result["stream_catchup_wall_eps"] = round(wall.rate)
        result["stream_catchup_wall_over_rebuild"] = round(wall.rate / p2.rate, 3)
        def table(path: Path) -> list[Any]:
            frame = spark.read.format("delta").load(str(path))
            return frame.select(*[c for c in frame.columns if c != GROUP_COLUMN]).orderBy("account_id").collect()

        expected = table(root / "parquet-0")
        assert table(root / "js-p1-0" / "balances") == expected, "JetStream and Parquet rebuilds differ"
        assert table(root / "arrow-0") == expected, "the Arrow-source and Parquet rebuilds differ"
        everything = balances(read_events(spark, settings, categories=["Account"], to_position=last, columns=columns))
        expected = everything.orderBy("account_id").collect()
        assert table(root / "js-p2-0" / "balances") == expected, "an update of the DataFrame projection differs"
        assert table(root / "fold-0" / "balances") == expected, "an update of the fold projection differs"
        assert table(root / "follow-0" / "balances") == expected, "a follower's tables differ"
        # Latency: a follower with a 1 s trigger (at `last` already: it starts from its tables' position) while
        # single appends arrive at random intervals; visible = the micro-batch holding it was written to Delta.
        follower = follow(spark, projection, settings, root / "follow-0", trigger_s=1.0, partitions=2)
        try:
            latencies = asyncio.run(stream_latencies(settings, follower, args.latency_samples))
        finally:
            follower.stop()
        log(f"stream latency over {len(latencies)} appends: " + ", ".join(f"{x:.2f}" for x in sorted(latencies)))
        result["stream_latency_p50_s"] = round(statistics.median(latencies), 2)
        result["stream_latency_p99_s"] = round(percentile(latencies, 0.99), 2)
        batches = follower.status
        result["stream_batch_s_last"] = None if batches is None else batches.seconds
        # The floor under a micro-batch: one Delta MERGE of a single row into a small table, nothing else.
        floor = root / "merge-floor"
        full_rebuild(spark.createDataFrame([(0, 0)], "k BIGINT, v BIGINT"), floor, app_id="floor", position=1)
        merges = []
        for n in range(2, 8):
            started = time.perf_counter()
            incremental_merge(spark.createDataFrame([(n % 3, n)], "k BIGINT, v BIGINT"), floor, keys=["k"],
                              app_id="floor", position=n)
            merges.append(time.perf_counter() - started)
        result["delta_merge_floor_s"] = round(statistics.median(merges[1:]), 2)
        spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

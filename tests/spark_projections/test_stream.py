"""``spark.readStream.format("jetstream")``: micro-batches of whole commits, each event once, restartable.

Real Spark (the shared session), a real nats-server, and the batch source as the
reference for what the stream holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession

from eventstore import EmbeddedServer, EntityAppend, EventStore, EventStoreSettings, StreamId
from spark_projections.errors import root_cause
from spark_projections.source import read_events
from spark_projections.stream import StreamOptions

from test_source import collect, interleaved_history


class Moved(BaseModel):
    n: int


Batches = list[tuple[int, list[tuple[Any, ...]]]]


def run_available_now(spark: SparkSession, settings: EventStoreSettings, checkpoint: Path, **options: Any) -> Batches:
    """Run a query with ``Trigger.AvailableNow`` to its end: each micro-batch's (id, rows) in order."""
    batches: Batches = []

    def keep(df: DataFrame, batch_id: int) -> None:
        batches.append((batch_id, sorted(tuple(r) for r in df.collect())))

    reader = spark.readStream.format("jetstream").option("url", settings.nats_url).option("stream", settings.stream)
    reader = reader.option("subject_prefix", settings.subject_prefix)
    for name, value in options.items():
        reader = reader.option(name, str(value))
    query = (
        reader.load().writeStream.foreachBatch(keep).option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True).start()
    )
    assert query.awaitTermination(120), "the query did not finish"
    assert query.exception() is None, query.exception()
    return batches


async def test_micro_batches_hold_every_event_once_and_never_split_an_atomic_batch(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    await interleaved_history(store)
    store.registry.register(Moved)
    atomic = await store.append_many(
        [EntityAppend(StreamId("Account", f"moved-{i}"), [Moved(n=i)]) for i in range(9)]
    )
    await interleaved_history(store)
    expected = collect(read_events(spark, store.settings))
    batches = run_available_now(spark, store.settings, tmp_path / "chk", max_events_per_trigger=7, partitions=3)
    rows = [row for _, batch in batches for row in batch]
    assert sorted(rows) == expected  # every event once
    assert len(batches) > 10  # bounded: about 7 positions each
    atomic_positions = {r.position for r in atomic}
    for _, batch in batches:
        positions = {row[0] for row in batch}
        assert len({p for p in positions if p not in atomic_positions}) <= 7
        if positions & atomic_positions:  # the batch of 9 positions arrived whole, in one micro-batch
            assert atomic_positions <= positions


async def test_a_restarted_query_goes_on_after_its_checkpoint(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    await interleaved_history(store)
    first = await store.last_position()
    before = run_available_now(spark, store.settings, tmp_path / "chk", categories="Account")
    await interleaved_history(store)
    after = run_available_now(spark, store.settings, tmp_path / "chk", categories="Account")
    again = run_available_now(spark, store.settings, tmp_path / "chk", categories="Account")
    seen = [row for _, batch in before + after + again for row in batch]
    assert sorted(seen) == collect(read_events(spark, store.settings, categories=["Account"]))
    assert all(row[0] <= first for _, batch in before for row in batch)
    assert all(row[0] > first for _, batch in after for row in batch)
    assert all(not batch for _, batch in again)
    assert after[0][0] > before[-1][0]  # the batch ids went on


async def test_starting_position_latest_or_a_position(spark: SparkSession, store: EventStore, tmp_path: Path) -> None:
    await interleaved_history(store)
    last = await store.last_position()
    latest = run_available_now(spark, store.settings, tmp_path / "latest", starting_position="latest")
    assert all(not batch for _, batch in latest)
    from_ten = run_available_now(spark, store.settings, tmp_path / "ten", starting_position=10)
    rows = sorted(row for _, batch in from_ten for row in batch)
    assert rows == collect(read_events(spark, store.settings, from_position=10))
    assert {row[0] for row in rows} == set(range(10, last + 1))


async def test_a_checkpoint_past_the_streams_end_fails_with_what_to_do(
    spark: SparkSession, store: EventStore, settings: EventStoreSettings, tmp_path: Path
) -> None:
    await interleaved_history(store)
    run_available_now(spark, store.settings, tmp_path / "chk")
    async with EventStore.connect(settings.model_copy(update={"stream": settings.stream + "X", "subject_prefix": settings.subject_prefix + "x"})) as other:
        other.registry.register(Moved)
        await other.append(StreamId("Account", "a"), [Moved(n=1)])
        with pytest.raises(PySparkException, match="new checkpoint location"):
            run_available_now(spark, other.settings, tmp_path / "chk")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"starting_position": "first"}, "'earliest', 'latest' or a position"),
        ({"starting_position": "0"}, "at least 1"),
        ({"max_events_per_trigger": "0"}, "at least 1"),
        ({"max_events_per_trigger": "lots"}, "must be an integer"),
        ({"outage_limit_s": "-1"}, "positive number of seconds, or 'none'"),
        ({"outage_limit_s": "soon"}, "positive number of seconds, or 'none'"),
        ({"outage_limit_s": "inf"}, "positive number of seconds, or 'none'"),
        ({"give_up_s": "30"}, "'give_up_s' is now 'outage_limit_s'"),
    ],
)
def test_bad_stream_options_are_refused_with_what_was_wrong(options: dict[str, str], message: str) -> None:
    with pytest.raises(Exception, match=message):
        StreamOptions.parse(options)


def test_stream_options_default_to_waiting_out_an_outage_for_ever() -> None:
    assert StreamOptions.parse({}).outage_limit_s is None
    assert StreamOptions.parse({"outage_limit_s": "none"}).outage_limit_s is None
    assert StreamOptions.parse({"outage_limit_s": "2.5"}).outage_limit_s == 2.5


def test_a_lost_server_fails_the_query_at_the_outage_limit_naming_it(spark: SparkSession, tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "js")
    server.start()
    url = server.url
    server.stop()
    settings = EventStoreSettings(nats_url=url)
    with pytest.raises(PySparkException) as failure:
        run_available_now(spark, settings, tmp_path / "chk", outage_limit_s=2, request_timeout_s=0.5)
    assert f"Could not connect to NATS at {url} within 0.5s" in str(failure.value)
    assert "the outage reached its limit of 2s" in root_cause(failure.value), root_cause(failure.value)

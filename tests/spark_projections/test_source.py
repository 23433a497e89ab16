"""The ``jetstream`` data source: every event exactly once, in range, across partitions.

Real Spark (the shared ``spark`` fixture), a real nats-server (``tests/conftest.py``), and
the event store's own reader as the reference for what the stream holds.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from eventstore import EmbeddedServer, EventStore, EventStoreSettings, StreamId, encode_commit
from eventstore.jetstream import Commits, Subjects
from spark_projections import _batches, _options, _range_reader, source
from spark_projections.source import EVENTS_SCHEMA, read_events, split_range


class Opened(BaseModel):
    owner: str


class Deposited(BaseModel):
    amount: int


class ItemAdded(BaseModel):
    sku: str
    qty: int


COLUMNS = [f.name for f in EVENTS_SCHEMA.fields]


async def interleaved_history(store: EventStore) -> None:
    """Accounts and carts interleaved commit by commit, some commits with several events."""
    for model in (Opened, Deposited, ItemAdded):
        store.registry.register(model)
    for i in range(40):
        account = StreamId("Account", f"acc-{i % 7}")
        if i < 7:
            await store.append(account, [Opened(owner=f"o{i}")], correlation_id=f"corr-{i}")
        elif i % 5 == 0:
            await store.append(account, [Deposited(amount=i), Deposited(amount=i + 1), Deposited(amount=i + 2)],
                               causation_id=f"cause-{i}")
        else:
            await store.append(account, [Deposited(amount=i)])
        cart = StreamId("Cart", f"cart {i % 3}.x@y")  # escaped in the subject: ' ', '.'
        await store.append(cart, [ItemAdded(sku=f"s{i}", qty=1)] * (1 + i % 2))


async def reference(store: EventStore, **kwargs: Any) -> list[tuple[Any, ...]]:
    """What the event store's own reader returns, as rows of the events schema."""
    rows = []
    async for batch in store.read_all(**kwargs):
        for e in batch:
            rows.append((
                e.position, e.index, str(e.stream_id), e.stream_id.category, e.stream_id.entity_id, e.version,
                e.type, e.schema_version, e.event_id, e.correlation_id, e.causation_id,
                e.recorded_at.replace(tzinfo=None), e.payload.decode(),
            ))
    return rows


def collect(df: Any) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in df.collect())


async def test_every_event_exactly_once_across_partitions_with_gaps(spark: SparkSession, store: EventStore) -> None:
    await interleaved_history(store)
    expected = await reference(store, categories=["Account"])
    assert len({r[0] for r in expected}) < len(expected)  # multi-event commits are in there
    for partitions in (1, 3, 8):
        rows = collect(read_events(spark, store.settings, categories=["Account"], partitions=partitions))
        assert rows == sorted(expected), partitions
    everything = collect(read_events(spark, store.settings, partitions=4))
    assert everything == sorted(await reference(store))
    carts = [r for r in everything if r[3] == "Cart"]
    assert {r[4] for r in carts} == {"cart 0.x@y", "cart 1.x@y", "cart 2.x@y"}
    assert {r[2] for r in carts} == {"Cart/cart 0.x@y", "Cart/cart 1.x@y", "Cart/cart 2.x@y"}


async def test_position_ranges_are_respected(spark: SparkSession, store: EventStore) -> None:
    await interleaved_history(store)
    everything = await reference(store)
    last = everything[-1][0]
    for low, high in [(1, 1), (5, 17), (18, last), (last, last), (last + 1, last + 10)]:
        rows = collect(read_events(spark, store.settings, from_position=low, to_position=high, partitions=3))
        assert rows == sorted(r for r in everything if low <= r[0] <= high), (low, high)
    # a range starting inside the stream and running past its end stops at the end
    tail = collect(read_events(spark, store.settings, from_position=last - 2, to_position=last + 50, partitions=2))
    assert [r[0] for r in tail][-1] == last


async def test_the_format_api_with_options(spark: SparkSession, store: EventStore) -> None:
    await interleaved_history(store)
    source.register(spark)
    settings = store.settings
    df = (
        spark.read.format("jetstream")
        .option("url", settings.nats_url)
        .option("stream", settings.stream)
        .option("subject_prefix", settings.subject_prefix)
        .option("categories", "Cart,Account")
        .option("from_position", 3)
        .option("to_position", 30)
        .option("partitions", 2)
        .option("batch", 7)  # many small pull requests
        .load()
    )
    assert df.columns == COLUMNS
    assert collect(df) == sorted(r for r in await reference(store) if 3 <= r[0] <= 30)
    multi = [r for r in collect(df) if r[0] == next(r[0] for r in collect(df) if r[1] == 2)]
    assert [r[1] for r in multi] == [0, 1, 2]
    assert len({r[5] for r in multi}) == 3  # versions count up inside the commit


async def test_empty_stream_and_empty_ranges_give_no_rows(spark: SparkSession, store: EventStore) -> None:
    assert read_events(spark, store.settings, partitions=3).count() == 0
    store.registry.register(Opened)
    await store.append(StreamId("Account", "a"), [Opened(owner="x")])
    assert read_events(spark, store.settings, categories=["Nothing"], partitions=2).count() == 0
    assert read_events(spark, store.settings, from_position=5, partitions=2).count() == 0


async def test_foreign_messages_and_bad_options_are_reported(spark: SparkSession, store: EventStore) -> None:
    source.register(spark)
    with pytest.raises(PySparkException, match="needs the server URL"):
        spark.read.format("jetstream").load().collect()
    with pytest.raises(PySparkException, match="Cannot read stream 'NOPE'"):
        spark.read.format("jetstream").option("url", store.settings.nats_url).option("stream", "NOPE").load().collect()
    with pytest.raises(PySparkException, match="Invalid category"):
        read_events(spark, store.settings, categories=["no such"]).collect()
    await store.nc.publish(f"{store.settings.subject_prefix}.Account.x", b"{}", headers={"Other": "1"})
    await store.nc.flush()
    await asyncio.sleep(0.1)
    with pytest.raises(PySparkException, match="not written by jetsourcing"):
        read_events(spark, store.settings).collect()


async def test_column_pruning_builds_only_the_named_columns(spark: SparkSession, store: EventStore) -> None:
    await interleaved_history(store)
    expected = await reference(store)
    picked = ["payload", "position", "index", "entity_id"]
    rows = read_events(spark, store.settings, columns=picked, partitions=2)
    assert rows.columns == picked
    at = [COLUMNS.index(c) for c in picked]
    assert collect(rows) == sorted(tuple(r[i] for i in at) for r in expected)
    source.register(spark)
    df = (spark.read.format("jetstream").schema("version BIGINT, recorded_at TIMESTAMP")
          .option("url", store.settings.nats_url).option("stream", store.settings.stream)
          .option("subject_prefix", store.settings.subject_prefix).load())
    assert collect(df) == sorted((r[5], r[11]) for r in expected)
    with pytest.raises(PySparkException, match="may only pick columns"):
        spark.read.format("jetstream").schema("version INT").option("url", store.settings.nats_url).load().collect()


def test_split_range() -> None:
    assert split_range(1, 10, 3) == [(1, 4), (5, 7), (8, 10)]
    assert split_range(5, 5, 4) == [(5, 5)]
    assert split_range(3, 2, 2) == []
    ranges = split_range(7, 1007, 16)
    assert ranges[0][0] == 7 and ranges[-1][1] == 1007
    assert all(b + 1 == c for (_, b), (c, _) in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("native", [True, False], ids=["native framing", "python framing"])
async def test_a_partition_survives_losing_its_consumer(store: EventStore, native: bool) -> None:
    """The range reader recreates a deleted consumer and still yields every message once, in order."""
    store.registry.register(Deposited)
    account = StreamId("Account", "a")
    js = store.nc.jetstream()
    for n in range(1, 401):
        headers, body = encode_commit(msg_id=f"m{n}", types=["Deposited"], schema_versions=[1], event_ids=[f"e{n}"],
                                      payloads=[json.dumps({"amount": n}).encode()], last_version=n,
                                      recorded_at="2026-01-01T00:00:00+00:00")
        await js.publish(account.subject(store.settings.subject_prefix), body, headers=headers)
    opts = _options.Options.parse({"url": store.settings.nats_url, "stream": store.settings.stream,
                                  "subject_prefix": store.settings.subject_prefix, "batch": "40"})
    shared = _range_reader.connections(opts)
    pull = _range_reader.range_replay(opts, 1, 400, shared, native=native)
    seen: list[int] = []
    kinds: set[type] = set()
    deleted = 0
    try:
        async for stored in pull.batches():
            seen += [p for part in stored for p in part.position_list()]
            kinds.update(type(part) for part in stored)
            if deleted < 2 and len(seen) >= 100 * (deleted + 1):
                deleted += 1
                await store.nc.request(Subjects(opts.stream).consumer_delete(pull._consumer.decode()), b"")
    finally:
        shared.close()
    assert deleted == 2
    assert seen == list(range(1, 401))
    assert (_batches.Frames in kinds) == native and (native or kinds == {Commits})


def test_events_schema_is_what_the_reader_returns() -> None:
    converted = _batches.Converter("p").convert(Commits(
        [9, 10],
        [b"p.Account.a%2Eb", b"p.Cart.c"],
        [b"NATS/1.0\r\nEs-Type: A,B\r\nEs-Schema-Version: 1,2\r\nEs-Event-Id: x,y\r\nEs-Version: 5\r\n"
         b"Es-Recorded-At: 2026-01-01T00:00:00.000001+00:00\r\nEs-Causation-Id: c\r\n\r\n",
         b"NATS/1.0\r\nNats-Msg-Id: m\r\nEs-Version: 1\r\nEs-Type: C\r\nEs-Schema-Version: 3\r\n"
         b"Es-Event-Id: z\r\nEs-Recorded-At: 2026-01-02T00:00:00Z\r\n\r\n"],
        [b'{"a":1}\n{"b":2}', b'{"c":3}'],
    ))
    rows = converted.to_pylist()
    assert [(r["position"], r["index"], r["stream_id"], r["entity_id"], r["version"], r["type"], r["schema_version"],
             r["event_id"], r["payload"], r["causation_id"]) for r in rows] == [
        (9, 0, "Account/a.b", "a.b", 4, "A", 1, "x", '{"a":1}', "c"),
        (9, 1, "Account/a.b", "a.b", 5, "B", 2, "y", '{"b":2}', "c"),
        (10, 0, "Cart/c", "c", 1, "C", 3, "z", '{"c":3}', None),
    ]
    assert rows[0]["recorded_at"].microsecond == 1


async def test_a_partition_survives_a_server_restart(tmp_path: Path) -> None:
    """Killed mid-read and restarted: the range reader reconnects, re-creates its consumer, misses nothing."""
    with EmbeddedServer(tmp_path / "nats") as server:
        settings = EventStoreSettings(nats_url=server.url, stream="RESTART", subject_prefix="r")
        store = await EventStore.connect(settings)
        try:
            js = store.nc.jetstream()
            acks = []
            for n in range(1, 2001):
                headers, body = encode_commit(msg_id=f"m{n}", types=["Deposited"], schema_versions=[1],
                                              event_ids=[f"e{n}"], payloads=[b"{}"], last_version=n,
                                              recorded_at="2026-01-01T00:00:00+00:00")
                acks.append(await js.publish_async("r.Account.a", body, headers=headers))
            await asyncio.gather(*acks)
        finally:
            await store.close()
        opts = _options.Options.parse({"url": server.url, "stream": "RESTART", "subject_prefix": "r", "batch": "100"})
        shared = _range_reader.connections(opts)
        seen: list[int] = []
        restarted = False
        pull = _range_reader.range_replay(opts, 1, 2000, shared)
        consumers: list[bytes] = []
        create = pull._create_consumer

        async def counting_create() -> None:
            await create()
            consumers.append(pull._consumer)

        pull._create_consumer = counting_create  # type: ignore[method-assign]
        try:
            async for stored in pull.batches():
                seen += [p for part in stored for p in part.position_list()]
                if not restarted and len(seen) >= 500:
                    restarted = True
                    await asyncio.to_thread(server.kill)
                    await asyncio.to_thread(server.start)
        finally:
            shared.close()
        assert restarted and len(consumers) >= 2  # the first consumer died with the server
        assert seen == list(range(1, 2001))

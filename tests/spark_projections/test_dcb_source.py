"""The Spark source over a stream holding DCB appends: their commits are read as every other commit, their index
messages (outside the event subjects, between the commits) never, whatever the partitions and ranges."""

from __future__ import annotations

from pydantic import BaseModel
from pyspark.sql import SparkSession

from eventstore import AppendCondition, EventStore, Query, StreamId, TaggedEvent
from spark_projections.source import read_events

from test_source import collect, reference


class Opened(BaseModel):
    owner: str


class Enrolled(BaseModel):
    student: str
    course: str


async def test_dcb_commits_are_read_once_and_index_messages_never(spark: SparkSession, store: EventStore) -> None:
    store.registry.register(Opened)
    store.registry.register(Enrolled)
    await store.dcb.ensure_index()
    for i in range(12):
        await store.append(StreamId("Account", f"a{i % 3}"), [Opened(owner=f"o{i}")])
        tags = {f"course:c{i % 2}", f"student:s{i}"}
        query = Query.of(tags=[f"course:c{i % 2}"]) | Query.of(tags=[f"student:s{i}"])
        condition = AppendCondition(query, await store.last_position())
        await store.dcb.append([TaggedEvent(Enrolled(student=f"s{i}", course=f"c{i % 2}"), tags)] * (1 + i % 2),
                               condition=condition if i % 3 else None)
    expected = sorted(await reference(store))
    assert {r[3] for r in expected} == {"Account", "Dcb"}
    assert await store.last_position() > expected[-1][0] - 1 and len({r[0] for r in expected}) == 24
    for partitions in (1, 4):
        assert collect(read_events(spark, store.settings, partitions=partitions)) == expected
    assert collect(read_events(spark, store.settings, categories=["Dcb"], partitions=3)) == [
        r for r in expected if r[3] == "Dcb"]
    last = await store.last_position()
    for low, high in [(1, 3), (2, 9), (5, last), (4, 4)]:  # ranges starting and ending among index messages
        rows = collect(read_events(spark, store.settings, from_position=low, to_position=high, partitions=2))
        assert rows == [r for r in expected if low <= r[0] <= high], (low, high)

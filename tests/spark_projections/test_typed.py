"""Typed decoding: Spark schemas from event models, payloads as columns, upcasting to the newest schema."""

from __future__ import annotations

from datetime import date, datetime, timezone
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import pytest
from pydantic import BaseModel, ConfigDict, Field
from pyspark.sql import SparkSession
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from aggregates import DomainEvent, register_events, upcaster
from eventstore import EventStore, StreamId, TypeRegistry, encode_commit
from spark_projections.source import read_events
from spark_projections.typed import TypedDecodingError, spark_schema, typed_events, typed_frames


class Tier(str, Enum):
    GOLD = "gold"
    SILVER = "silver"


class Address(BaseModel):
    street: str
    zip: int | None = None


class Line(BaseModel):
    sku: str
    price: Annotated[Decimal, Field(max_digits=10, decimal_places=2)]
    tags: list[str] = []


class OrderPlaced(BaseModel):
    order_id: str
    count: int
    ratio: float
    express: bool
    placed_at: datetime
    due: date
    total: Decimal
    lines: list[Line]
    address: Address
    note: Optional[str] = None
    billing: Address | None = None
    scores: dict[str, int] = {}
    tier: Tier = Tier.GOLD
    channel: Literal["web", "shop"] = "web"
    anything: int | str = 0


class Aliased(BaseModel):
    model_config = ConfigDict(serialize_by_alias=True)
    value: int = Field(alias="Value")


class Node(BaseModel):
    name: str
    children: list["Node"] = []


def S(*fields: StructField) -> StructType:
    return StructType(list(fields))


def f(name: str, kind: Any) -> StructField:
    return StructField(name, kind, True)


def test_spark_schema_covers_the_pydantic_types() -> None:
    line = S(f("sku", StringType()), f("price", DecimalType(10, 2)), f("tags", ArrayType(StringType())))
    address = S(f("street", StringType()), f("zip", LongType()))
    assert spark_schema(OrderPlaced) == S(
        f("order_id", StringType()),
        f("count", LongType()),
        f("ratio", DoubleType()),
        f("express", BooleanType()),
        f("placed_at", TimestampType()),
        f("due", DateType()),
        f("total", DecimalType(38, 18)),
        f("lines", ArrayType(line)),
        f("address", address),
        f("note", StringType()),
        f("billing", address),
        f("scores", MapType(StringType(), LongType())),
        f("tier", StringType()),
        f("channel", StringType()),
        f("anything", StringType()),  # a union of several types: its raw JSON
    )
    assert spark_schema(Aliased) == S(f("Value", LongType()))
    assert spark_schema(Node) == S(f("name", StringType()), f("children", ArrayType(StringType())))


# -- upcasting: an event at schema version 3, with events stored at 1, 2 and 3 ----------------


class Deposited(DomainEvent, type_name="TypedDeposited", version=3):
    amount_cents: int
    currency: str
    booked_on: date | None = None


@upcaster(Deposited, from_version=1)
def _add_currency(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "currency": "EUR"}


@upcaster(Deposited, from_version=2)
def _to_cents(data: dict[str, Any]) -> dict[str, Any]:
    return {"amount_cents": data["amount"] * 100, "currency": data["currency"]}


class Renamed(DomainEvent, type_name="TypedRenamed"):
    name: str


@pytest.fixture(scope="module")
def shipped(spark: SparkSession) -> None:
    """Executors import this module's events and upcasters (in production: an installed package)."""
    spark.sparkContext.addPyFile(str(Path(__file__)))


async def test_typed_events_upcast_old_versions_to_the_newest_schema(
    spark: SparkSession, store: EventStore, shipped: None
) -> None:
    registry = TypeRegistry()
    register_events(registry, [Deposited, Renamed])
    stream = StreamId("Account", "a")
    subject = stream.subject(store.settings.subject_prefix)
    js = store.nc.jetstream()
    stored = [(1, '{"amount":5}'), (2, '{"amount":7,"currency":"USD"}'),
              (3, '{"amount_cents":900,"currency":"CHF","booked_on":"2026-03-01"}'), (1, '{"amount":1}')]
    for version, (schema_version, payload) in enumerate(stored, start=1):
        headers, body = encode_commit(
            msg_id=f"m{version}", types=["TypedDeposited"], schema_versions=[schema_version], event_ids=[f"e{version}"],
            payloads=[payload.encode()], last_version=version, recorded_at="2026-01-01T00:00:00+00:00",
        )
        await js.publish(subject, body, headers=headers)
    store.registry.register(Renamed)
    await store.append(stream, [Renamed(name="Ann")])
    events = read_events(spark, store.settings, partitions=2)

    deposits = typed_events(events, registry, Deposited).orderBy("position")
    assert deposits.columns == [
        "position", "index", "stream_id", "category", "entity_id", "version", "type", "schema_version",
        "event_id", "correlation_id", "causation_id", "recorded_at", "amount_cents", "currency", "booked_on",
    ]
    rows = [(r.version, r.schema_version, r.amount_cents, r.currency, r.booked_on) for r in deposits.collect()]
    assert rows == [
        (1, 3, 500, "EUR", None),
        (2, 3, 700, "USD", None),
        (3, 3, 900, "CHF", date(2026, 3, 1)),
        (4, 3, 100, "EUR", None),
    ]
    frames = typed_frames(events, registry)
    assert set(frames) == {"TypedDeposited", "TypedRenamed"}
    assert [r.name for r in frames["TypedRenamed"].collect()] == ["Ann"]
    nested = typed_events(events, registry, "TypedRenamed", flatten=False)
    assert nested.select("data.name").first()[0] == "Ann"


async def test_typed_columns_round_trip_every_type(spark: SparkSession, store: EventStore, shipped: None) -> None:
    registry = TypeRegistry()
    registry.register(OrderPlaced)
    store.registry.register(OrderPlaced)
    placed = OrderPlaced(
        order_id="o1", count=3, ratio=0.25, express=True, placed_at=datetime(2026, 5, 4, 3, 2, 1, 123456, timezone.utc),
        due=date(2026, 6, 1), total=Decimal("1234.5678"), lines=[Line(sku="a", price=Decimal("9.99"), tags=["x"])],
        address=Address(street="Main 1", zip=1000), scores={"q": 2}, tier=Tier.SILVER, anything="free text",
    )
    await store.append(StreamId("Order", "o1"), [placed])
    row = typed_events(read_events(spark, store.settings), registry, OrderPlaced).first()
    assert row is not None
    assert (row.order_id, row["count"], row.ratio, row.express) == ("o1", 3, 0.25, True)
    assert row.placed_at == datetime(2026, 5, 4, 3, 2, 1, 123456)  # UTC session time zone
    assert (row.due, row.total) == (date(2026, 6, 1), Decimal("1234.567800000000000000"))
    assert row.lines[0].asDict(recursive=True) == {"sku": "a", "price": Decimal("9.99"), "tags": ["x"]}
    assert row.address.asDict() == {"street": "Main 1", "zip": 1000}
    assert (row.note, row.billing, row.scores, row.tier, row.channel, row.anything) == (
        None, None, {"q": 2}, "silver", "web", "free text")


async def test_clashing_fields_and_bad_payloads_are_reported(spark: SparkSession, store: EventStore) -> None:
    class Versioned(BaseModel):
        version: int

    registry = TypeRegistry()
    registry.register(Versioned)
    events = read_events(spark, store.settings)
    with pytest.raises(TypedDecodingError, match="flatten=False"):
        typed_events(events, registry, Versioned)
    assert typed_events(events, registry, Versioned, flatten=False).columns[-1] == "data"

    class Amount(BaseModel):
        amount: int

    registry.register(Amount)
    headers, body = encode_commit(msg_id="bad", types=["Amount"], schema_versions=[1], event_ids=["e"],
                                  payloads=[b'{"amount":"lots"}'], last_version=1, recorded_at="2026-01-01T00:00:00Z")
    await store.nc.jetstream().publish(f"{store.settings.subject_prefix}.Account.a", body, headers=headers)
    with pytest.raises(Exception, match="MALFORMED_RECORD_IN_PARSING"):  # FAILFAST: no silent nulls
        typed_events(read_events(spark, store.settings), registry, Amount).collect()

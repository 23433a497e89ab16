"""A user's projections, in a module that is not installed (the cluster test copies it to a temporary folder)."""

from pydantic import BaseModel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from eventstore import EventStore, EventStoreSettings, RecordedEvent, StreamId
from projections import Projection, Table, Transaction, handles
from spark_projections import DataFrameProjection


class Opened(BaseModel):
    owner: str


class Paid(BaseModel):
    amount: int


class Balances(Projection):
    name = "lc_balances"
    categories = ("Wallet",)
    tables = (Table("balances", key="wallet", columns={"wallet": str, "owner": str, "total": int, "payments": int}),)

    @handles(Opened)
    def opened(self, event: RecordedEvent, tx: Transaction) -> None:
        tx.upsert("balances", event.stream_id.entity_id, {"owner": event.data.owner, "total": 0, "payments": 0})

    @handles(Paid)
    def paid(self, event: RecordedEvent, tx: Transaction) -> None:
        row = tx.get("balances", event.stream_id.entity_id)
        if row is not None:
            tx.upsert("balances", event.stream_id.entity_id,
                      {**row, "total": row["total"] + event.data.amount, "payments": row["payments"] + 1})


def payments(events: DataFrame) -> DataFrame:
    paid = events.where(F.col("type") == "Paid")
    return paid.groupBy(F.col("entity_id").alias("wallet")).agg(
        F.sum(F.get_json_object("payload", "$.amount").cast("long")).alias("total"), F.count(F.lit(1)).alias("payments"))


PAYMENTS = DataFrameProjection(name="lc_payments", build=payments, keys=("wallet",), categories=("Wallet",),
                               combine={"total": "sum", "payments": "sum"})


async def append(settings: EventStoreSettings, start: int, count: int) -> int:
    """Events ``start`` to ``start + count - 1`` of a fixed history on 20 wallets (the first 20 open them)."""
    async with EventStore.connect(settings) as store:
        for model in (Opened, Paid):
            store.registry.register(model)
        for i in range(start, start + count):
            wallet = StreamId("Wallet", f"w{i % 20}")
            await store.append(wallet, [Opened(owner=f"owner-{i}")] if i < 20 else [Paid(amount=i)])
        return await store.last_position()

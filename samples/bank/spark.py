"""Spark-only read models of the bank: DataFrame projections over the events, for the data team.

The daemon's projections (:mod:`samples.bank.projections`) run in Spark as
they are: the same handlers, folded per account. A DataFrame projection is
the other form: a plain function from the events DataFrame to a table, free to
aggregate across every account, which a per-entity fold cannot do.

:data:`DAILY_TOTALS` -- the bank's totals per value date: money in, money
out, transfers, net change and the number of movements. Its columns combine
by addition, so an incremental update aggregates only the new events and
adds them to the stored rows.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

# Not exported by spark_projections/__init__.py yet (see samples/spark_demo.py): the module's own __all__ name.
from spark_projections import DataFrameProjection

from .events import Deposited, MoneyReceived, MoneyReturned, MoneySent, Withdrawn

__all__ = ["DAILY_TOTALS", "daily_totals"]

_MOVEMENTS = [e.__event_type__ for e in (Deposited, Withdrawn, MoneySent, MoneyReceived, MoneyReturned)]


def _amount_of(*types: type) -> Column:
    """The movement's amount when its type is one of ``types``, else 0."""
    names = [t.__event_type__ for t in types]  # type: ignore[attr-defined]
    return F.when(F.col("type").isin(names), F.col("amount")).otherwise(F.lit(0))


def daily_totals(events: DataFrame) -> DataFrame:
    """One row per value date: deposits, withdrawals, transfers in/out (net of paybacks), net, movements (cents)."""
    movements = events.where(F.col("type").isin(_MOVEMENTS)).select(
        "type",
        F.get_json_object("payload", "$.amount").cast("long").alias("amount"),
        F.get_json_object("payload", "$.value_date").alias("day"),
    )
    transfers_out = _amount_of(MoneySent) - _amount_of(MoneyReturned)
    return movements.groupBy("day").agg(
        F.sum(_amount_of(Deposited)).alias("deposits"),
        F.sum(_amount_of(Withdrawn)).alias("withdrawals"),
        F.sum(_amount_of(MoneyReceived)).alias("transfers_in"),
        F.sum(transfers_out).alias("transfers_out"),
        F.sum(_amount_of(Deposited, MoneyReceived, MoneyReturned) - _amount_of(Withdrawn, MoneySent)).alias("net"),
        F.count(F.lit(1)).alias("movements"),
    )


DAILY_TOTALS = DataFrameProjection(
    name="daily_totals",
    build=daily_totals,
    keys=("day",),
    categories=("Account",),
    combine={c: "sum" for c in ("deposits", "withdrawals", "transfers_in", "transfers_out", "net", "movements")},
)
"""The bank's totals per value date, as a DataFrame projection (incremental: sums combine)."""

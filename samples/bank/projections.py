"""The bank's read models, written once and run by the SQLite daemon and by Spark alike.

* :class:`AccountBalances` -- one row per account: owner, balance, number of
  movements, and the position of the last event applied.
* :class:`DailyMovements` -- one row per account and value date: money in and
  out by kind (the daily totals a back office reconciles).
* :class:`TransferStatuses` -- one row per process-manager transfer: where it
  stands.

Every handler is a deterministic function of the event and the rows it reads
(the day comes from the event's ``value_date``, never from a clock), and
touches only rows keyed by the event's own entity: that is what lets Spark
fold each entity's events independently and get the same tables as the
daemon.
"""

from __future__ import annotations

from datetime import date
from typing import Any, ClassVar

from eventstore import RecordedEvent
from projections import Projection, Table, Transaction, handles

from .events import (
    AccountOpened,
    Deposited,
    MoneyReceived,
    MoneyReturned,
    MoneySent,
    TransferCompleted,
    TransferDebited,
    TransferFailed,
    TransferRequested,
    Withdrawn,
)

__all__ = ["AccountBalances", "DailyMovements", "TransferStatuses", "BANK_PROJECTIONS"]

def _signed(data: object) -> int:
    """The movement's effect on the balance, in cents."""
    if isinstance(data, (Deposited, MoneyReceived, MoneyReturned)):
        return data.amount
    if isinstance(data, (Withdrawn, MoneySent)):
        return -data.amount
    raise TypeError(f"not a movement: {data!r}")


class AccountBalances(Projection):
    """One row per account: owner, balance (cents), number of movements, last position applied."""

    name = "account_balances"
    version = 1
    categories = ("Account",)
    tables = (
        Table(
            "balances",
            key="account_id",
            columns={"account_id": str, "owner": str, "balance": int, "movements": int, "last_position": int},
            indexes=["owner"],
        ),
    )

    @handles(AccountOpened)
    def opened(self, event: RecordedEvent, tx: Transaction) -> None:
        """A new row at balance 0."""
        data = event.data
        assert isinstance(data, AccountOpened)
        tx.upsert("balances", event.stream_id.entity_id,
                  {"owner": data.owner, "balance": 0, "movements": 0, "last_position": event.position})

    @handles(Deposited, Withdrawn, MoneySent, MoneyReceived, MoneyReturned)
    def moved(self, event: RecordedEvent, tx: Transaction) -> None:
        """Any movement: adjust the balance, count it."""
        row = tx.get("balances", event.stream_id.entity_id)
        if row is None:  # cannot happen for accounts written by samples.bank (opening comes first)
            return
        row["balance"] += _signed(event.data)
        row["movements"] += 1
        row["last_position"] = event.position
        tx.upsert("balances", event.stream_id.entity_id, row)


class DailyMovements(Projection):
    """Per account and value date: deposits, withdrawals, transfers in and out, net change (cents)."""

    name = "daily_movements"
    version = 1
    categories = ("Account",)
    tables = (
        Table("owners", key="account_id", columns={"account_id": str, "owner": str}),
        Table(
            "daily",
            key=("account_id", "day"),
            columns={
                "account_id": str,
                "day": str,
                "owner": str,
                "deposits": int,
                "withdrawals": int,
                "transfers_in": int,
                "transfers_out": int,
                "net": int,
                "movements": int,
            },
            indexes=["day", "owner"],
        ),
    )

    _COLUMN: ClassVar[dict[type, str]] = {
        Deposited: "deposits",
        Withdrawn: "withdrawals",
        MoneySent: "transfers_out",
        MoneyReceived: "transfers_in",
        # A payback undoes a transfer out on the day it is booked.
        MoneyReturned: "transfers_out",
    }

    @handles(AccountOpened)
    def opened(self, event: RecordedEvent, tx: Transaction) -> None:
        """Remember the owner, so daily rows can carry it."""
        data = event.data
        assert isinstance(data, AccountOpened)
        tx.upsert("owners", event.stream_id.entity_id, {"owner": data.owner})

    @handles(Deposited, Withdrawn, MoneySent, MoneyReceived, MoneyReturned)
    def moved(self, event: RecordedEvent, tx: Transaction) -> None:
        """Add the movement to its day's row."""
        data = event.data
        account = event.stream_id.entity_id
        day: date = data.value_date  # type: ignore[attr-defined]  # every movement has one
        key = (account, day.isoformat())
        row: dict[str, Any] | None = tx.get("daily", key)
        if row is None:
            owner = tx.get("owners", account)
            row = {"owner": owner["owner"] if owner else "", "deposits": 0, "withdrawals": 0, "transfers_in": 0,
                   "transfers_out": 0, "net": 0, "movements": 0}
        column = self._COLUMN[type(data)]
        amount = data.amount  # type: ignore[attr-defined]
        row[column] += -amount if isinstance(data, MoneyReturned) else amount
        row["net"] += _signed(data)
        row["movements"] += 1
        tx.upsert("daily", key, row)


class TransferStatuses(Projection):
    """One row per transfer run by the process manager: accounts, amount, status and why it failed."""

    name = "transfer_statuses"
    version = 1
    categories = ("Transfer",)
    tables = (
        Table(
            "transfers",
            key="transfer_id",
            columns={"transfer_id": str, "from_account": str, "to_account": str, "amount": int, "status": str,
                     "reason": str | None},
            indexes=["status"],
        ),
    )

    @handles(TransferRequested)
    def requested(self, event: RecordedEvent, tx: Transaction) -> None:
        """A new transfer."""
        data = event.data
        assert isinstance(data, TransferRequested)
        tx.upsert("transfers", event.stream_id.entity_id, {
            "from_account": data.from_account, "to_account": data.to_account, "amount": data.amount,
            "status": "requested",
        })

    @handles(TransferDebited, TransferCompleted, TransferFailed)
    def moved_on(self, event: RecordedEvent, tx: Transaction) -> None:
        """The next step: debited, completed or failed (with the reason)."""
        row = tx.get("transfers", event.stream_id.entity_id)
        if row is None:
            return
        data = event.data
        if isinstance(data, TransferFailed):
            row["status"], row["reason"] = "failed", data.reason
        else:
            row["status"] = "debited" if isinstance(data, TransferDebited) else "completed"
        tx.upsert("transfers", event.stream_id.entity_id, row)


BANK_PROJECTIONS: tuple[type[Projection], ...] = (AccountBalances, DailyMovements, TransferStatuses)
"""Every read model of the bank."""

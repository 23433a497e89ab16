"""Example projections used by the projection tests (and free to reuse by samples and Spark tests).

* :class:`AccountBalances` -- one row per open account keyed by account id,
  read-modify-write per event, deletes on close, a second table; handlers
  keyed by event class.
* :class:`Movements` -- a composite key ``(account_id, version)``, handlers
  keyed by type name, reading the raw JSON payload (no registry needed).
* :class:`FragileBalances` -- AccountBalances plus a handler that fails on
  ``Corrupted`` events: the poison-event tests.

Run one with ``jetsourcing run projection_examples:AccountBalances`` (with
``tests/projections`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence

from pydantic import BaseModel

from eventstore import EventStore, RecordedEvent, StreamId
from projections import Projection, Table, Transaction, handles

ACCOUNT = "Account"


class AccountOpened(BaseModel):
    owner: str


class Deposited(BaseModel):
    amount: int


class Withdrawn(BaseModel):
    amount: int


class AccountClosed(BaseModel):
    reason: str


class Corrupted(BaseModel):
    detail: str


class AccountBalances(Projection):
    """Balances of open accounts, and the final balance of closed ones."""

    name = "account_balances"
    version = 1
    categories = (ACCOUNT,)
    tables = (
        Table(
            "balances",
            key="account_id",
            columns={
                "account_id": str,
                "owner": str,
                "balance": int,
                "deposits": int,
                "withdrawals": int,
                "last_position": int,
                "average_deposit": float | None,
                "overdrawn": bool,
            },
            indexes=["owner"],
        ),
        Table("closures", key="account_id", columns={"account_id": str, "final_balance": int, "reason": str}),
    )

    @handles(AccountOpened)
    def opened(self, event: RecordedEvent, tx: Transaction) -> None:
        data = event.data
        assert isinstance(data, AccountOpened)
        tx.upsert("balances", event.stream_id.entity_id, {
            "owner": data.owner, "balance": 0, "deposits": 0, "withdrawals": 0,
            "last_position": event.position, "overdrawn": False,
        })

    @handles(Deposited)
    def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
        data = event.data
        assert isinstance(data, Deposited)
        row = tx.get("balances", event.stream_id.entity_id)
        if row is None:
            return
        row["balance"] += data.amount
        row["deposits"] += 1
        row["average_deposit"] = ((row["average_deposit"] or 0.0) * (row["deposits"] - 1) + data.amount) / row["deposits"]
        row["last_position"] = event.position
        row["overdrawn"] = row["balance"] < 0
        tx.upsert("balances", event.stream_id.entity_id, row)

    @handles(Withdrawn)
    def withdrawn(self, event: RecordedEvent, tx: Transaction) -> None:
        data = event.data
        assert isinstance(data, Withdrawn)
        row = tx.get("balances", event.stream_id.entity_id)
        if row is None:
            return
        row["balance"] -= data.amount
        row["withdrawals"] += 1
        row["last_position"] = event.position
        row["overdrawn"] = row["balance"] < 0
        tx.upsert("balances", event.stream_id.entity_id, row)

    @handles(AccountClosed)
    def closed(self, event: RecordedEvent, tx: Transaction) -> None:
        data = event.data
        assert isinstance(data, AccountClosed)
        account = event.stream_id.entity_id
        row = tx.get("balances", account)
        tx.delete("balances", account)
        tx.upsert("closures", account, {"final_balance": row["balance"] if row else 0, "reason": data.reason})


class Movements(Projection):
    """Every deposit and withdrawal, keyed by (account, version); handlers by type name on the raw payload."""

    name = "movements"
    version = 1
    tables = (
        Table("movements", key=("account_id", "version"),
              columns={"account_id": str, "version": int, "amount": int, "kind": str}),
    )

    @handles("Deposited", "Withdrawn")
    def movement(self, event: RecordedEvent, tx: Transaction) -> None:
        amount = json.loads(event.payload)["amount"]
        tx.upsert("movements", (event.stream_id.entity_id, event.version), {
            "amount": amount if event.type == "Deposited" else -amount, "kind": event.type,
        })

    @handles("AccountClosed")
    def closed(self, event: RecordedEvent, tx: Transaction) -> None:
        # Drop the opening movement marker of a closed account, if any (exercises deletes on composite keys).
        tx.delete("movements", (event.stream_id.entity_id, 2))


class FragileBalances(AccountBalances):
    """AccountBalances under another name, whose ``Corrupted`` handler always fails (a poison event)."""

    name = "fragile_balances"

    @handles(Corrupted)
    def corrupted(self, event: RecordedEvent, tx: Transaction) -> None:
        tx.upsert("balances", event.stream_id.entity_id, {
            "owner": "poison", "balance": 0, "deposits": 0, "withdrawals": 0, "last_position": 0, "overdrawn": False,
        })
        raise ValueError(f"cannot apply {event.data!r}")


def register_all(store: EventStore) -> None:
    """Register the example events (writers need them; projections register what they handle)."""
    for model in (AccountOpened, Deposited, Withdrawn, AccountClosed, Corrupted):
        store.registry.register(model)


def workload(count: int, accounts: int, seed: int = 7) -> list[tuple[str, list[BaseModel]]]:
    """A deterministic list of appends (account id, events): opens, deposits, withdrawals, some closes.

    About one append in twenty holds two events (one commit, one position).
    """
    rng = random.Random(seed)
    opened: set[str] = set()
    closed: set[str] = set()
    out: list[tuple[str, list[BaseModel]]] = []
    produced = 0
    while produced < count:
        account = f"acc-{rng.randrange(accounts):05d}"
        if account in closed:
            continue
        events: list[BaseModel]
        if account not in opened:
            opened.add(account)
            events = [AccountOpened(owner=f"owner-{rng.randrange(50)}")]
        else:
            roll = rng.random()
            if roll < 0.01:
                closed.add(account)
                events = [AccountClosed(reason="customer request")]
            elif roll < 0.06:
                events = [Deposited(amount=rng.randrange(1, 500)), Withdrawn(amount=rng.randrange(1, 300))]
            elif roll < 0.6:
                events = [Deposited(amount=rng.randrange(1, 1000))]
            else:
                events = [Withdrawn(amount=rng.randrange(1, 800))]
        events = events[: count - produced]
        produced += len(events)
        out.append((account, events))
    return out


async def append_workload(
    store: EventStore, appends: Sequence[tuple[str, list[BaseModel]]], concurrency: int = 64
) -> None:
    """Append ``appends`` (per-account order kept, accounts interleaved) with bounded concurrency."""
    queues: dict[str, list[list[BaseModel]]] = {}
    order: list[str] = []
    for account, events in appends:
        if account not in queues:
            queues[account] = []
            order.append(account)
        queues[account].append(events)
    sem = asyncio.Semaphore(concurrency)

    async def one(account: str) -> None:
        async with sem:
            for events in queues[account]:
                await store.append(StreamId(ACCOUNT, account), events)

    async with asyncio.timeout(max(120.0, len(appends) / 100)):
        await asyncio.gather(*(one(a) for a in order))


class AccountBalancesV2(AccountBalances):
    """Version 2 of account_balances: deposits of 500 or more count twice (a changed rule: must be rebuilt)."""

    version = 2

    @handles(Deposited)
    def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
        super().deposited(event, tx)
        data = event.data
        assert isinstance(data, Deposited)
        if data.amount >= 500:
            row = tx.get("balances", event.stream_id.entity_id)
            if row is not None:
                row["deposits"] += 1
                tx.upsert("balances", event.stream_id.entity_id, row)


class SlowBalances(AccountBalancesV2):
    """AccountBalancesV2 that takes 2 ms per deposit: a rebuild slow enough to be interrupted by a test."""

    @handles(Deposited)
    def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
        import time

        time.sleep(0.002)
        super().deposited(event, tx)


class DoubleApplyError(AssertionError):
    """An event reached a handler of a read model that had already applied it."""


class LedgerBalances(AccountBalances):
    """AccountBalances that also keeps, per account, the last (position, index) applied, and fails on an event at
    or before it: a double apply stops the daemon (``stop`` policy) instead of hiding in the sums."""

    name = "ledger_balances"
    tables = (*AccountBalances.tables,
              Table("applied", key="account_id", columns={"account_id": str, "position": int, "event_index": int,
                                                          "events": int}))

    def _once(self, event: RecordedEvent, tx: Transaction) -> None:
        account = event.stream_id.entity_id
        row = tx.get("applied", account)
        if row is not None and (event.position, event.index) <= (row["position"], row["event_index"]):
            raise DoubleApplyError(f"{account}: event ({event.position}, {event.index}) applied after "
                                   f"({row['position']}, {row['event_index']})")
        tx.upsert("applied", account, {"position": event.position, "event_index": event.index,
                                       "events": (row["events"] if row else 0) + 1})

    @handles(AccountOpened)
    def opened(self, event: RecordedEvent, tx: Transaction) -> None:
        self._once(event, tx)
        super().opened(event, tx)

    @handles(Deposited)
    def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
        self._once(event, tx)
        super().deposited(event, tx)

    @handles(Withdrawn)
    def withdrawn(self, event: RecordedEvent, tx: Transaction) -> None:
        self._once(event, tx)
        super().withdrawn(event, tx)

    @handles(AccountClosed)
    def closed(self, event: RecordedEvent, tx: Transaction) -> None:
        self._once(event, tx)
        super().closed(event, tx)

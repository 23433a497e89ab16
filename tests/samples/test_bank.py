"""The sample bank's rules on a real server: no overdraft, atomic transfers, the transfer process manager."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from datetime import date

import pytest

from aggregates import AggregateExistsError, CommandClient, CommandRejectedError, Repository
from eventstore import EventStore, StreamId
from projections import MemoryStore, fold
from samples.bank.commands import Deposit, OpenAccount, Withdraw, command_service
from samples.bank import (
    Account,
    AccountBalances,
    AccountNotOpen,
    Bank,
    BankError,
    DailyMovements,
    InsufficientFunds,
    MoneyReceived,
    MoneySent,
    TransferError,
    TransferProcess,
    TransferStatuses,
)

DAY = date(2025, 3, 3)


async def open_with(bank: Bank, balances: dict[str, int]) -> None:
    for account, amount in balances.items():
        await bank.open_account(account, f"owner of {account}")
        if amount:
            await bank.deposit(account, amount, DAY)


async def balances(bank: Bank, *accounts: str) -> list[int]:
    return [await bank.balance(a) for a in accounts]


async def settle(process: TransferProcess) -> None:
    """Run a worker of the process manager until nothing is pending or in flight."""
    await asyncio.wait_for(process.worker(concurrency=4, until_idle=True).run(), 30)


# -- accounts -------------------------------------------------------------------------


async def test_an_overdraft_is_refused_and_stores_nothing(bank: Bank, store: EventStore) -> None:
    await open_with(bank, {"alice": 100_00})
    before = await store.last_position()
    with pytest.raises(InsufficientFunds, match="overdrafts are not allowed") as refused:
        await bank.withdraw("alice", 100_01, DAY)
    assert (refused.value.balance, refused.value.amount) == (100_00, 100_01)
    assert await store.last_position() == before
    assert await bank.withdraw("alice", 100_00, DAY) == 0  # the whole balance is fine
    with pytest.raises(BankError, match="positive"):
        await bank.deposit("alice", 0, DAY)
    with pytest.raises(AggregateExistsError, match="Account 'alice' exists already"):
        await bank.open_account("alice", "Mallory")


async def test_a_retried_deposit_with_the_same_command_id_is_stored_once(bank: Bank, store: EventStore) -> None:
    await open_with(bank, {"alice": 0})
    assert await bank.deposit("alice", 5_00, DAY, command_id="req-1") == 5_00
    assert await bank.deposit("alice", 5_00, DAY, command_id="req-1") == 5_00  # the client retried
    assert await store.version(StreamId("Account", "alice")) == 2


# -- atomic transfers ---------------------------------------------------------------------


async def test_an_atomic_transfer_stores_both_legs_or_nothing(bank: Bank, store: EventStore) -> None:
    await open_with(bank, {"alice": 100_00, "bob": 0})
    await bank.transfer("t1", "alice", "bob", 40_00, DAY)
    assert await balances(bank, "alice", "bob") == [60_00, 40_00]
    [sent] = (await store.read(StreamId("Account", "alice")))[-1:]
    [received] = (await store.read(StreamId("Account", "bob")))[-1:]
    assert isinstance(sent.data, MoneySent) and isinstance(received.data, MoneyReceived)
    assert sent.correlation_id == received.correlation_id == "t1"

    before = await store.last_position()
    with pytest.raises(InsufficientFunds):
        await bank.transfer("t2", "alice", "bob", 60_01, DAY)
    with pytest.raises(BankError, match="does not exist"):
        await bank.transfer("t3", "alice", "nobody", 1_00, DAY)
    with pytest.raises(BankError, match="cannot pay itself"):
        await bank.transfer("t4", "alice", "alice", 1_00, DAY)
    assert await store.last_position() == before, "a refused transfer stores neither leg"
    assert await balances(bank, "alice", "bob") == [60_00, 40_00]


async def test_concurrent_transfers_and_withdrawals_never_overdraw_and_conserve_money(store: EventStore) -> None:
    accounts = [f"a{n}" for n in range(4)]
    bank = Bank(store)
    await open_with(bank, dict.fromkeys(accounts, 100_00))
    rng = random.Random(3)
    refused = Counter[str]()
    paid_out = 0

    async def transfer(n: int) -> None:
        source, target = rng.sample(accounts, 2)
        try:
            # Separate Bank objects (no shared per-aggregate turn-taking): conflicts go through the server.
            await Bank(store).transfer(f"t{n}", source, target, rng.randrange(1_00, 60_00), DAY)
        except InsufficientFunds:
            refused["transfer"] += 1

    async def withdraw() -> None:
        nonlocal paid_out
        amount = rng.randrange(1_00, 30_00)
        try:
            await bank.withdraw(rng.choice(accounts), amount, DAY)
            paid_out += amount
        except InsufficientFunds:
            refused["withdraw"] += 1

    await asyncio.gather(*(transfer(n) for n in range(40)), *(withdraw() for _ in range(20)))
    final = await balances(Bank(store), *accounts)
    assert min(final) >= 0
    assert sum(final) == 4 * 100_00 - paid_out
    assert refused["transfer"] < 40, "most transfers went through despite the conflicts"


# -- the process manager ---------------------------------------------------------------------


async def test_the_process_manager_completes_refuses_and_pays_back(bank: Bank, store: EventStore) -> None:
    await open_with(bank, {"alice": 100_00, "bob": 0})
    await bank.request_transfer("ok", "alice", "bob", 30_00, DAY)
    await bank.request_transfer("too-much", "alice", "bob", 500_00, DAY)
    await bank.request_transfer("nowhere", "alice", "closed", 20_00, DAY)
    with pytest.raises(TransferError, match="positive"):
        await bank.request_transfer("zero", "alice", "bob", 0, DAY)
    assert await balances(bank, "alice", "bob") == [100_00, 0], "a request moves nothing by itself"

    await settle(TransferProcess(store))

    states = {t: (await bank.transfers.get(t)).state for t in ("ok", "too-much", "nowhere")}
    assert states["ok"].status == "completed"
    assert (states["too-much"].status, states["too-much"].refunded) == ("failed", False)
    assert "debit refused" in states["too-much"].reason
    assert (states["nowhere"].status, states["nowhere"].refunded) == ("failed", True)
    assert "credit refused" in states["nowhere"].reason
    assert await balances(bank, "alice", "bob") == [70_00, 30_00]
    alice = [e.type for e in await store.read(StreamId("Account", "alice"))]
    assert alice == ["AccountOpened", "Deposited", "MoneySent", "MoneySent", "MoneyReturned"]


async def test_redelivered_events_change_nothing(bank: Bank, store: EventStore) -> None:
    """Every step crashes once right after its first command; the redelivery re-runs it as a duplicate."""
    await open_with(bank, {"alice": 100_00, "bob": 10_00})
    transfers = {f"t{n}": ("alice", "bob", 5_00) for n in range(6)}
    transfers |= {"back": ("bob", "alice", 7_00), "broke": ("bob", "alice", 999_00), "lost": ("alice", "gone", 1_00)}
    for transfer_id, (source, target, amount) in transfers.items():
        await bank.request_transfer(transfer_id, source, target, amount, DAY)

    process = TransferProcess(store, simulate_crashes=100, retry_backoff_s=(0.05,), ack_wait_s=5)
    await settle(process)

    # Crashes happen after a first command that stored something: debits (8), credits (7), the payback (1).
    assert process.stats.crashes == 16
    assert process.stats.duplicates == process.stats.crashes, "each re-run command stored nothing new"
    account_events = [e for a in ("alice", "bob") for e in await store.read(StreamId("Account", a))]
    per_transfer = Counter((e.type, e.data.transfer_id) for e in account_events if hasattr(e.data, "transfer_id"))
    assert len(per_transfer) == 16 and set(per_transfer.values()) == {1}, per_transfer
    assert await balances(bank, "alice", "bob") == [100_00 - 30_00 + 7_00, 10_00 + 30_00 - 7_00]
    statuses = Counter([(await bank.transfers.get(t)).state.status for t in transfers])
    assert statuses == Counter({"completed": 7, "failed": 2})

    # A delivery long after the store's duplicate window (here: a second reactor, whose command ids differ)
    # finds every step already decided by the transfer's own state, and does nothing.
    late = TransferProcess(store, name="late-replay")
    last = await store.last_position()
    await settle(late)
    assert (late.stats.commands, late.stats.skipped) == (0, 9 + 8)  # 9 requests, 8 debits
    assert await store.last_position() == last


# -- read models ---------------------------------------------------------------------------


async def test_read_models_agree_with_the_aggregates(bank: Bank, store: EventStore) -> None:
    await open_with(bank, {"alice": 100_00, "bob": 50_00, "carol": 0})
    await bank.transfer("a1", "alice", "carol", 25_00, date(2025, 3, 4))
    await bank.withdraw("bob", 10_00, date(2025, 3, 4))
    await bank.request_transfer("p1", "bob", "alice", 5_00, date(2025, 3, 5))
    await settle(TransferProcess(store))
    with pytest.raises(AccountNotOpen):
        await Repository(store, Account).execute("dave", lambda a: a.deposit(1, DAY), create=True)

    models = {}
    for projection in (AccountBalances(), DailyMovements(), TransferStatuses()):
        projection.bind(store.registry)
        memory = MemoryStore.for_projection(projection)
        async for batch in store.read_all(categories=projection.categories):
            fold(projection, batch, memory)
        models[projection.name] = memory.dump()

    rows = {r["account_id"]: r for r in models["account_balances"]["balances"]}
    for account in ("alice", "bob", "carol"):
        assert rows[account]["balance"] == await bank.balance(account)
    assert [rows[a]["movements"] for a in ("alice", "bob", "carol")] == [3, 3, 1]
    daily = {(r["account_id"], r["day"]): r for r in models["daily_movements"]["daily"]}
    assert daily[("alice", "2025-03-04")]["transfers_out"] == 25_00
    assert daily[("bob", "2025-03-05")]["owner"] == "owner of bob"
    assert sum(r["net"] for r in daily.values()) == sum(r["balance"] for r in rows.values())
    [p1] = models["transfer_statuses"]["transfers"]
    assert (p1["transfer_id"], p1["status"], p1["amount"]) == ("p1", "completed", 5_00)


async def test_the_bank_serves_its_account_commands_over_nats(bank: Bank, store: EventStore) -> None:
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    async with command_service(store, subject_prefix=prefix):
        client = CommandClient(store, subject_prefix=prefix)
        await client.send(Account, "acc-nats", OpenAccount(owner="Nat"))
        assert (await client.send(Account, "acc-nats", Deposit(amount=500, value_date=DAY))).value == 500
        with pytest.raises(CommandRejectedError) as refused:
            await client.send(Account, "acc-nats", Withdraw(amount=501, value_date=DAY))
        assert refused.value.error_type == "InsufficientFunds" and "balance is 5.00" in str(refused.value)
        assert (await client.send(Account, "acc-nats", Withdraw(amount=200, value_date=DAY))).value == 300
    assert await bank.balance("acc-nats") == 300

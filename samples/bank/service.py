"""The bank's application service: one object with a method per use case, over the repositories.

This is what an API endpoint or a message handler would call. Each method is
one command on one aggregate through :meth:`~aggregates.Repository.execute`
(load, decide, append, retried on conflicts), except the atomic transfer,
which saves two accounts in one append.
"""

from __future__ import annotations

from datetime import date

from aggregates import Repository
from eventstore import EventStore

from .account import Account
from .transfer import Transfer, transfer_atomically

__all__ = ["Bank"]


class Bank:
    """Use cases of the bank on one event store. Safe for many concurrent tasks on one event loop."""

    def __init__(self, store: EventStore, *, cache_size: int = 10_000) -> None:
        self.store = store
        # A cache as large as the working set saves every command its load (stale entries only cost a retry).
        self.accounts = Repository(store, Account, cache_size=cache_size)
        self.transfers = Repository(store, Transfer, cache_size=cache_size)

    async def open_account(self, account_id: str, owner: str) -> None:
        """Open a new account; refused (:class:`aggregates.AggregateExistsError`) if the account exists already."""
        await self.accounts.execute(account_id, lambda a: a.open(owner), create=True)

    async def deposit(self, account_id: str, amount: int, value_date: date, *, command_id: str | None = None) -> int:
        """Pay in; returns the new balance. ``command_id`` makes a retried request harmless."""
        result = await self.accounts.execute(account_id, lambda a: a.deposit(amount, value_date), command_id=command_id)
        return result.value if result.value is not None else (await self.accounts.get(account_id)).state.balance

    async def withdraw(self, account_id: str, amount: int, value_date: date, *, command_id: str | None = None) -> int:
        """Pay out; raises :class:`~samples.bank.account.InsufficientFunds` beyond the balance."""
        result = await self.accounts.execute(
            account_id, lambda a: a.withdraw(amount, value_date), command_id=command_id
        )
        return result.value if result.value is not None else (await self.accounts.get(account_id)).state.balance

    async def transfer(
        self, transfer_id: str, from_account: str, to_account: str, amount: int, value_date: date
    ) -> None:
        """Move money now, both legs in one atomic append (see :func:`~samples.bank.transfer.transfer_atomically`)."""
        await transfer_atomically(self.accounts, transfer_id, from_account, to_account, amount, value_date)

    async def request_transfer(
        self, transfer_id: str, from_account: str, to_account: str, amount: int, value_date: date
    ) -> None:
        """Ask for a transfer that the process manager (:mod:`samples.bank.process`) carries out later."""
        await self.transfers.execute(
            transfer_id, lambda t: t.request(from_account, to_account, amount, value_date), create=True,
            command_id=f"request:{transfer_id}",
        )

    async def balance(self, account_id: str) -> int:
        """The account's balance from its events (the write side; read models may lag behind)."""
        return (await self.accounts.get(account_id)).state.balance

    async def transfer_status(self, transfer_id: str) -> str:
        """Where a process-manager transfer stands, from its events."""
        return (await self.transfers.get(transfer_id)).state.status

"""The bank's account commands, served over NATS: ``jetsourcing serve`` or :func:`command_service`.

Each command is a pydantic model; the service sends it to the account's
aggregate through a repository (see :mod:`aggregates.service`), so any
process that holds a :class:`~aggregates.CommandClient` can run it::

    client = CommandClient(store)
    await client.send(Account, "acc-1", Deposit(amount=500, value_date=date.today()))
"""

from __future__ import annotations

from datetime import date
from typing import Any

from pydantic import BaseModel

from aggregates import CommandService, Repository
from eventstore import EventStore

from .account import Account

__all__ = ["Deposit", "OpenAccount", "Withdraw", "command_service"]


class OpenAccount(BaseModel):
    """Open a new account for ``owner`` (refused with ``AggregateExistsError`` if the account exists already)."""

    owner: str


class Deposit(BaseModel):
    """Pay ``amount`` cents in; the reply's value is the new balance."""

    amount: int
    value_date: date


class Withdraw(BaseModel):
    """Pay ``amount`` cents out; refused beyond the balance (``InsufficientFunds``)."""

    amount: int
    value_date: date


def command_service(store: EventStore, *, cache_size: int = 10_000, **options: Any) -> CommandService:
    """A :class:`CommandService` for the bank's account commands (``options`` go to the service)."""
    accounts = Repository(store, Account, cache_size=cache_size)
    service = CommandService(store, **options)
    service.add(accounts, OpenAccount, lambda account, c: account.open(c.owner), create=True)
    service.add(accounts, Deposit, lambda account, c: account.deposit(c.amount, c.value_date))
    service.add(accounts, Withdraw, lambda account, c: account.withdraw(c.amount, c.value_date))
    return service

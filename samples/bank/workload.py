"""A reproducible day-to-day workload for the bank: customers, accounts, and a mix of commands run concurrently.

:func:`plan` draws everything from a seeded random generator, so a run with
the same sizes and seed issues the same commands (their interleaving, and so
which overdrafts are refused, still depends on timing). :func:`run_commands`
sends them through :class:`~samples.bank.service.Bank` with bounded
concurrency and counts what was accepted and refused; refusals are part of a
normal day, anything else is an error and propagates.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Literal

from .account import BankError
from .service import Bank

__all__ = ["Command", "Customer", "Tally", "plan", "open_accounts", "run_commands", "MISSING_ACCOUNT"]

CommandKind = Literal["deposit", "withdraw", "transfer", "request_transfer"]

FIRST_DAY = date(2025, 3, 3)
"""The first value date of the workload (a Monday); commands spread over that working week."""

MISSING_ACCOUNT = "acc-closed-0000"
"""An account id that is never opened: process-manager transfers to it fail on the credit and are paid back."""

_FIRST = ("Ada", "Alan", "Barbara", "Claude", "Dennis", "Edsger", "Frances", "Grace", "Hedy", "Ivan", "John",
          "Katherine", "Ken", "Leslie", "Margaret", "Niklaus", "Radia", "Shafi", "Tim", "Whitfield")
_LAST = ("Allen", "Backus", "Cerf", "Dijkstra", "Engelbart", "Floyd", "Goldwasser", "Hamilton", "Hopper", "Iverson",
         "Johnson", "Kahn", "Lamport", "Liskov", "McCarthy", "Perlman", "Ritchie", "Sutherland", "Thompson", "Wirth")


@dataclass(frozen=True, slots=True)
class Customer:
    """An account to open and its owner."""

    account_id: str
    owner: str
    initial_deposit: int


@dataclass(frozen=True, slots=True)
class Command:
    """One request to the bank (amount in cents)."""

    kind: CommandKind
    ident: str
    account: str
    amount: int
    value_date: date
    other: str = ""
    """The destination account of a transfer."""


@dataclass
class Tally:
    """What the bank accepted and refused, and the cash that came in and went out (cents)."""

    accepted: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    cash_in: int = 0
    cash_out: int = 0
    refusals: list[str] = field(default_factory=list)
    """A few refusal messages, as examples."""

    @property
    def money_in_bank(self) -> int:
        """What all balances must add up to: transfers only move money around."""
        return self.cash_in - self.cash_out

    def refuse(self, kind: str, error: Exception) -> None:
        """Count a refusal (and keep its message as an example)."""
        self.refused[kind] += 1
        if len(self.refusals) < 3:
            self.refusals.append(f"{kind}: {error}")


def plan(accounts: int, commands: int, *, seed: int = 2025, prefix: str = "") -> tuple[list[Customer], list[Command]]:
    """Customers for ``accounts`` accounts (about three per owner) and ``commands`` commands on them.

    Command ids (and transfer ids) start with ``prefix``: give each batch of
    commands its own, since a repeated id is a retry and stores nothing.

    The mix: 35% deposits, 30% withdrawals (some overdraw and are refused),
    20% atomic transfers, 15% process-manager transfers (one in twenty of
    them to an account that does not exist, to exercise the compensation).
    """
    if accounts < 2:
        raise ValueError("The workload needs at least two accounts.")
    rng = random.Random(seed)
    names = [f"{first} {last}" for first in _FIRST for last in _LAST]
    rng.shuffle(names)
    owners = names[: max(1, min(len(names), accounts // 3))]
    customers = [
        Customer(f"acc-{n:04d}", rng.choice(owners), rng.randrange(50_00, 2_000_00))
        for n in range(1, accounts + 1)
    ]
    ids = [c.account_id for c in customers]
    out: list[Command] = []
    for n in range(commands):
        roll = rng.random()
        day = FIRST_DAY + timedelta(days=rng.randrange(5))
        account = rng.choice(ids)
        other = account
        while other == account:
            other = rng.choice(ids)
        if roll < 0.35:
            out.append(Command("deposit", f"{prefix}dep-{n}", account, rng.randrange(10_00, 500_00), day))
        elif roll < 0.65:
            out.append(Command("withdraw", f"{prefix}wdr-{n}", account, rng.randrange(10_00, 900_00), day))
        elif roll < 0.85:
            out.append(Command("transfer", f"{prefix}atx-{n}", account, rng.randrange(10_00, 700_00), day, other))
        else:
            if rng.random() < 0.05:
                other = MISSING_ACCOUNT
            amount = rng.randrange(10_00, 700_00)
            out.append(Command("request_transfer", f"{prefix}ptx-{n}", account, amount, day, other))
    return customers, out


async def open_accounts(bank: Bank, customers: Sequence[Customer], tally: Tally, *, concurrency: int = 64) -> None:
    """Open every account and make its first deposit."""
    gate = asyncio.Semaphore(concurrency)

    async def one(customer: Customer) -> None:
        async with gate:
            await bank.open_account(customer.account_id, customer.owner)
            await bank.deposit(customer.account_id, customer.initial_deposit, FIRST_DAY)
            tally.accepted["open"] += 1
            tally.cash_in += customer.initial_deposit

    await asyncio.gather(*(one(c) for c in customers))


async def run_commands(
    bank: Bank,
    commands: Sequence[Command],
    tally: Tally,
    *,
    concurrency: int = 64,
    on_done: Callable[[], None] | None = None,
) -> None:
    """Run ``commands`` concurrently (at most ``concurrency`` at a time), counting outcomes into ``tally``."""
    gate = asyncio.Semaphore(concurrency)

    async def one(command: Command) -> None:
        async with gate:
            try:
                if command.kind == "deposit":
                    await bank.deposit(command.account, command.amount, command.value_date, command_id=command.ident)
                    tally.cash_in += command.amount
                elif command.kind == "withdraw":
                    await bank.withdraw(command.account, command.amount, command.value_date, command_id=command.ident)
                    tally.cash_out += command.amount
                elif command.kind == "transfer":
                    await bank.transfer(command.ident, command.account, command.other, command.amount,
                                        command.value_date)
                else:
                    await bank.request_transfer(command.ident, command.account, command.other, command.amount,
                                                command.value_date)
            except BankError as refused:
                tally.refuse(command.kind, refused)
            else:
                tally.accepted[command.kind] += 1
            if on_done is not None:
                on_done()

    await asyncio.gather(*(one(c) for c in commands))

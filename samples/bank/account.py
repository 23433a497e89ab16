"""The ``Account`` aggregate: open, deposit, withdraw, and the two legs of a transfer. No overdraft, ever.

Every command checks its rule against the state rebuilt from the account's
own events and records what happened; the ``@applies`` handlers only move the
state. Refusals raise a :class:`BankError` (a :class:`~aggregates.DomainError`),
which :meth:`~aggregates.Repository.execute` never retries and never stores.
"""

from __future__ import annotations

from datetime import date

from pydantic import BaseModel

from aggregates import Aggregate, DomainError, applies

from .events import AccountOpened, Deposited, MoneyReceived, MoneyReturned, MoneySent, Withdrawn

__all__ = ["Account", "AccountNotOpen", "AccountState", "BankError", "InsufficientFunds"]


class BankError(DomainError):
    """A banking command was refused; nothing was recorded."""


class InsufficientFunds(BankError):
    """A debit larger than the balance: the bank allows no overdraft."""

    def __init__(self, account_id: str, balance: int, amount: int) -> None:
        self.account_id = account_id
        self.balance = balance
        self.amount = amount
        super().__init__(
            f"Account {account_id!r} cannot pay {amount / 100:.2f}: its balance is {balance / 100:.2f} "
            "and overdrafts are not allowed."
        )


class AccountNotOpen(BankError):
    """A command on an account that was never opened."""


class AccountState(BaseModel):
    """What an account knows about itself (amounts in cents)."""

    owner: str = ""
    balance: int = 0
    is_open: bool = False


class Account(Aggregate[AccountState]):
    """A current account without overdraft (category ``Account``)."""

    # -- commands ------------------------------------------------------------

    def open(self, owner: str) -> None:
        """Open the account for ``owner``; refused if it is already open."""
        if self.state.is_open:
            raise BankError(f"Account {self.id!r} is already open (owner {self.state.owner!r}).")
        if not owner.strip():
            raise BankError("An account needs an owner.")
        self.record(AccountOpened(owner=owner))

    def deposit(self, amount: int, value_date: date) -> int:
        """Pay ``amount`` cents in; returns the new balance."""
        self._check(amount)
        self.record(Deposited(amount=amount, value_date=value_date))
        return self.state.balance

    def withdraw(self, amount: int, value_date: date) -> int:
        """Pay ``amount`` cents out; refused with :class:`InsufficientFunds` beyond the balance."""
        self._check(amount)
        self._check_funds(amount)
        self.record(Withdrawn(amount=amount, value_date=value_date))
        return self.state.balance

    def send(self, transfer_id: str, to_account: str, amount: int, value_date: date) -> None:
        """Debit leg of a transfer; refused with :class:`InsufficientFunds` beyond the balance."""
        self._check(amount)
        if to_account == self.id:
            raise BankError(f"Transfer {transfer_id!r}: an account cannot pay itself.")
        self._check_funds(amount)
        self.record(MoneySent(transfer_id=transfer_id, to_account=to_account, amount=amount, value_date=value_date))

    def receive(self, transfer_id: str, from_account: str, amount: int, value_date: date) -> None:
        """Credit leg of a transfer."""
        self._check(amount)
        self.record(
            MoneyReceived(transfer_id=transfer_id, from_account=from_account, amount=amount, value_date=value_date)
        )

    def pay_back(self, transfer_id: str, amount: int, value_date: date) -> None:
        """Return the debit of a transfer whose credit was refused (the compensation of :meth:`send`)."""
        self._check(amount)
        self.record(MoneyReturned(transfer_id=transfer_id, amount=amount, value_date=value_date))

    def _check(self, amount: int) -> None:
        if not self.state.is_open:
            raise AccountNotOpen(f"Account {self.id!r} is not open.")
        if amount <= 0:
            raise BankError(f"Amounts must be positive, not {amount}.")

    def _check_funds(self, amount: int) -> None:
        if amount > self.state.balance:
            raise InsufficientFunds(self.id, self.state.balance, amount)

    # -- handlers: state changes only, no rules (the events already happened) --

    @applies(AccountOpened)
    def _opened(self, event: AccountOpened) -> None:
        self.state.owner = event.owner
        self.state.is_open = True

    @applies(Deposited)
    def _deposited(self, event: Deposited) -> None:
        self.state.balance += event.amount

    @applies(Withdrawn)
    def _withdrawn(self, event: Withdrawn) -> None:
        self.state.balance -= event.amount

    @applies(MoneySent)
    def _sent(self, event: MoneySent) -> None:
        self.state.balance -= event.amount

    @applies(MoneyReceived)
    def _received(self, event: MoneyReceived) -> None:
        self.state.balance += event.amount

    @applies(MoneyReturned)
    def _returned(self, event: MoneyReturned) -> None:
        self.state.balance += event.amount

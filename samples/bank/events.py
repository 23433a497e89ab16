"""The bank's domain events: facts, in integer cents, each with the business date it is booked on.

Movements carry a ``value_date`` (the day the bank books them) in the payload
rather than relying on when the event was appended: projections must be
deterministic functions of the events, and a replay next year must still put
a deposit on the day it was booked.
"""

from __future__ import annotations

from datetime import date

from aggregates import DomainEvent

__all__ = [
    "ACCOUNT_EVENTS",
    "AccountOpened",
    "Deposited",
    "MoneyReceived",
    "MoneyReturned",
    "MoneySent",
    "TRANSFER_EVENTS",
    "TransferCompleted",
    "TransferDebited",
    "TransferFailed",
    "TransferRequested",
    "Withdrawn",
]

# -- accounts ------------------------------------------------------------------


class AccountOpened(DomainEvent):
    """An account was opened for ``owner``."""

    owner: str


class Deposited(DomainEvent):
    """Cash was paid in."""

    amount: int
    value_date: date


class Withdrawn(DomainEvent):
    """Cash was paid out."""

    amount: int
    value_date: date


class MoneySent(DomainEvent):
    """The account was debited for transfer ``transfer_id`` to ``to_account``."""

    transfer_id: str
    to_account: str
    amount: int
    value_date: date


class MoneyReceived(DomainEvent):
    """The account was credited by transfer ``transfer_id`` from ``from_account``."""

    transfer_id: str
    from_account: str
    amount: int
    value_date: date


class MoneyReturned(DomainEvent):
    """A debit for transfer ``transfer_id`` was paid back because the credit side refused it."""

    transfer_id: str
    amount: int
    value_date: date


ACCOUNT_EVENTS: tuple[type[DomainEvent], ...] = (
    AccountOpened, Deposited, Withdrawn, MoneySent, MoneyReceived, MoneyReturned,
)
"""Every event an account records."""

# -- transfers (the process manager's own history) -----------------------------


class TransferRequested(DomainEvent):
    """A customer asked to move ``amount`` from one account to another; nothing has moved yet."""

    from_account: str
    to_account: str
    amount: int
    value_date: date


class TransferDebited(DomainEvent):
    """The source account was debited; the credit is next."""


class TransferCompleted(DomainEvent):
    """The destination account was credited: the transfer is done."""


class TransferFailed(DomainEvent):
    """The transfer was given up; ``refunded`` says whether a debit had to be paid back."""

    reason: str
    refunded: bool


TRANSFER_EVENTS: tuple[type[DomainEvent], ...] = (TransferRequested, TransferDebited, TransferCompleted, TransferFailed)
"""Every event a transfer records."""

"""Moving money between accounts, two ways.

* :func:`transfer_atomically` debits one account and credits the other in
  **one atomic append** (:meth:`~aggregates.Repository.save_all`, a JetStream
  atomic batch): both events are stored, or neither. Simple and strongly
  consistent, but both accounts must be written by the same command.
* The :class:`Transfer` aggregate is the state of a **process manager**
  (:mod:`samples.bank.process`): a transfer is requested first, then a reactor
  debits, then credits, each step its own command on its own aggregate. It
  tolerates accounts owned by other services, and failures in between:

  ``requested -> debited -> completed``, or ``requested -> failed`` (debit
  refused), or ``requested -> debited -> failed`` (credit refused, debit paid
  back).
"""

from __future__ import annotations

import asyncio
from datetime import date
from typing import Literal

from pydantic import BaseModel

from aggregates import Aggregate, AggregateNotFoundError, Repository, RetryPolicy, applies
from eventstore import ConcurrencyError

from .account import Account, BankError
from .events import TransferCompleted, TransferDebited, TransferFailed, TransferRequested

__all__ = ["Transfer", "TransferError", "TransferState", "TransferStatus", "transfer_atomically"]

TransferStatus = Literal["new", "requested", "debited", "completed", "failed"]


class TransferError(BankError):
    """A command on a transfer was refused."""


class TransferState(BaseModel):
    """Where a transfer stands (amount in cents)."""

    from_account: str = ""
    to_account: str = ""
    amount: int = 0
    value_date: date = date(1970, 1, 1)
    status: TransferStatus = "new"
    reason: str = ""
    refunded: bool = False


class Transfer(Aggregate[TransferState]):
    """A transfer run step by step by the process manager (category ``Transfer``).

    The step commands are idempotent by their nature: marking a transfer with
    the status it already has records nothing. Together with the reactor's
    command ids this makes a redelivered event harmless, even after the
    store's duplicate window.
    """

    def request(self, from_account: str, to_account: str, amount: int, value_date: date) -> None:
        """Ask for the transfer; validated here, executed later by the process manager."""
        if self.state.status != "new":
            raise TransferError(f"Transfer {self.id!r} was already requested.")
        if amount <= 0:
            raise TransferError(f"Transfer {self.id!r}: amounts must be positive, not {amount}.")
        if from_account == to_account:
            raise TransferError(f"Transfer {self.id!r}: an account cannot pay itself.")
        self.record(TransferRequested(from_account=from_account, to_account=to_account, amount=amount,
                                      value_date=value_date))

    def mark_debited(self) -> None:
        """The source account paid; refused once the transfer failed."""
        if self.state.status in ("debited", "completed"):
            return  # already known: nothing to record
        self._expect("requested", "mark as debited")
        self.record(TransferDebited())

    def complete(self) -> None:
        """The destination account was credited."""
        if self.state.status == "completed":
            return
        self._expect("debited", "complete")
        self.record(TransferCompleted())

    def fail(self, reason: str, *, refunded: bool) -> None:
        """Give up the transfer (``refunded``: the debit was paid back)."""
        if self.state.status == "failed":
            return
        if self.state.status not in ("requested", "debited"):
            raise TransferError(f"Transfer {self.id!r} is {self.state.status} and can no longer fail.")
        self.record(TransferFailed(reason=reason, refunded=refunded))

    def _expect(self, status: TransferStatus, action: str) -> None:
        if self.state.status != status:
            raise TransferError(f"Cannot {action} transfer {self.id!r}: it is {self.state.status}, not {status}.")

    @applies(TransferRequested)
    def _requested(self, event: TransferRequested) -> None:
        self.state.from_account = event.from_account
        self.state.to_account = event.to_account
        self.state.amount = event.amount
        self.state.value_date = event.value_date
        self.state.status = "requested"

    @applies(TransferDebited)
    def _debited(self, event: TransferDebited) -> None:
        self.state.status = "debited"

    @applies(TransferCompleted)
    def _completed(self, event: TransferCompleted) -> None:
        self.state.status = "completed"

    @applies(TransferFailed)
    def _failed(self, event: TransferFailed) -> None:
        self.state.status = "failed"
        self.state.reason = event.reason
        self.state.refunded = event.refunded


async def transfer_atomically(
    accounts: Repository[Account],
    transfer_id: str,
    from_account: str,
    to_account: str,
    amount: int,
    value_date: date,
    *,
    retry: RetryPolicy = RetryPolicy(),
) -> None:
    """Debit ``from_account`` and credit ``to_account`` in one atomic append: both are stored, or neither.

    Raises :class:`BankError` (nothing stored) when the debit is refused or an
    account is missing. ``save_all`` checks both accounts' versions on the
    server; when another command wrote to either of them since they were
    loaded, it raises :class:`~eventstore.ConcurrencyError` and stores nothing,
    and the transfer is loaded and decided again (``retry`` bounds how often).
    """
    for attempt in range(retry.attempts):
        try:
            source = await accounts.get(from_account)
            target = await accounts.get(to_account)
        except AggregateNotFoundError as exc:
            raise BankError(str(exc)) from exc
        # Both legs are decided on the state just loaded; a refusal raises before anything is stored.
        source.send(transfer_id, to_account, amount, value_date)
        target.receive(transfer_id, from_account, amount, value_date)
        try:
            await accounts.save_all([source, target], correlation_id=transfer_id)
            return
        except ConcurrencyError:
            if attempt + 1 == retry.attempts:
                raise
            await asyncio.sleep(retry.delay_s(attempt))

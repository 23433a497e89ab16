"""A small bank on jetsourcing: accounts, transfers (atomic and by process manager), read models.

If you are here to read the code, go in this order: ``events.py`` (the facts),
``account.py`` (the ``Account`` aggregate: no overdraft), ``transfer.py``
(atomic transfers with ``save_all``, and the ``Transfer`` aggregate),
``process.py`` (the reactor that drives transfers, idempotently),
``service.py`` (the use cases), ``projections.py`` (read models for the
daemon and Spark), ``spark.py`` (Spark-only views) and ``workload.py`` (what
the demo runs).
"""

from .account import Account, AccountNotOpen, AccountState, BankError, InsufficientFunds
from .events import (
    ACCOUNT_EVENTS,
    TRANSFER_EVENTS,
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
from .process import ProcessStats, SimulatedCrash, TransferProcess
from .projections import BANK_PROJECTIONS, AccountBalances, DailyMovements, TransferStatuses
from .service import Bank
from .transfer import Transfer, TransferError, TransferState, TransferStatus, transfer_atomically

__all__ = [
    "ACCOUNT_EVENTS",
    "Account",
    "AccountBalances",
    "AccountNotOpen",
    "AccountOpened",
    "AccountState",
    "BANK_PROJECTIONS",
    "Bank",
    "BankError",
    "DailyMovements",
    "Deposited",
    "InsufficientFunds",
    "MoneyReceived",
    "MoneyReturned",
    "MoneySent",
    "ProcessStats",
    "SimulatedCrash",
    "TRANSFER_EVENTS",
    "Transfer",
    "TransferCompleted",
    "TransferDebited",
    "TransferError",
    "TransferFailed",
    "TransferProcess",
    "TransferRequested",
    "TransferState",
    "TransferStatus",
    "TransferStatuses",
    "Withdrawn",
    "transfer_atomically",
]

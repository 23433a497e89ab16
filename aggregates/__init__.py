"""Aggregates: the part of jetsourcing you write your domain code against.

If you are here to read the code, start with ``events.py`` (:class:`DomainEvent`),
then ``aggregate.py`` (:class:`Aggregate`, ``@applies``), ``repository.py``
(loading, saving, :meth:`Repository.execute`), ``commands.py`` (retries and
results), ``snapshots.py``, ``upcasting.py`` and ``errors.py``. Commands over
NATS: ``service.py`` (:class:`CommandService`), ``client.py``
(:class:`CommandClient`) and their wire format, ``command_messages.py``. Commands decided on the events of
queries across entities (dynamic consistency boundaries): ``decisions.py``. The
application object: ``application.py``; given/when/then tests: ``testing.py``.

Example::

    from pydantic import BaseModel
    from aggregates import Aggregate, DomainError, DomainEvent, Repository, applies

    class Deposited(DomainEvent):
        amount: int

    class AccountState(BaseModel):
        balance: int = 0

    class Account(Aggregate[AccountState]):
        def deposit(self, amount: int) -> None:
            if amount <= 0:
                raise DomainError("Deposit a positive amount.")
            self.record(Deposited(amount=amount))

        @applies(Deposited)
        def _deposited(self, event: Deposited) -> None:
            self.state.balance += event.amount

    accounts = Repository(store, Account)
    await accounts.execute("alice", lambda a: a.deposit(10), create=True, exist_ok=True)  # create or update
"""

from .aggregate import Aggregate, applies
from .application import Application, new_id
from .client import CommandClient, CommandReply
from .commands import CacheStats, CommandResult, RetryPolicy
from .decisions import DecisionResult, Decisions, Fold
from .errors import (
    AggregateDefinitionError,
    AggregateError,
    AggregateExistsError,
    AggregateNotFoundError,
    CommandConflictError,
    CommandError,
    CommandFailedError,
    CommandRejectedError,
    CommandUnavailableError,
    DomainError,
    InvalidCommandError,
    InvalidAggregateIdError,
    InvalidStoredEventError,
    MissingHandlerError,
    UnregisteredEventError,
)
from .events import DomainEvent, register_events
from .repository import Repository
from .routing import DEFAULT_PARTITIONS, partition_of
from .testing import Scenario, scenario
from .service import CommandService
from .upcasting import upcaster

__all__ = [
    "Aggregate",
    "AggregateDefinitionError",
    "AggregateError",
    "AggregateExistsError",
    "AggregateNotFoundError",
    "Application",
    "CacheStats",
    "CommandClient",
    "CommandConflictError",
    "CommandError",
    "CommandFailedError",
    "CommandRejectedError",
    "CommandReply",
    "CommandResult",
    "CommandService",
    "CommandUnavailableError",
    "DEFAULT_PARTITIONS",
    "DecisionResult",
    "Decisions",
    "DomainError",
    "DomainEvent",
    "Fold",
    "InvalidAggregateIdError",
    "InvalidCommandError",
    "InvalidStoredEventError",
    "MissingHandlerError",
    "Repository",
    "RetryPolicy",
    "Scenario",
    "UnregisteredEventError",
    "applies",
    "new_id",
    "partition_of",
    "register_events",
    "scenario",
    "upcaster",
]

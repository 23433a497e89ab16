"""The transfer process manager: a reactor that drives each :class:`~samples.bank.transfer.Transfer` to its end.

It reacts to the transfer's own events, one step at a time::

    TransferRequested -> debit the source account   -> mark the transfer debited
                                       (refused)    -> fail the transfer
    TransferDebited   -> credit the target account  -> complete the transfer
                                       (refused)    -> pay the debit back, fail the transfer (refunded)

A reactor delivers at least once: a worker may die (or a handler fail) after
a command was stored but before the event was acknowledged, and the event
comes again. Every command therefore carries a **command id derived from the
event id** (``reactor.idempotency_key(event, step)``): re-running it stores
nothing and reports ``duplicate=True``. On top of that the handlers look at
the transfer's status first and do nothing for a step already decided, and
the transfer's own step commands record nothing when repeated, so a very
late redelivery (after the store's duplicate window) is harmless too.

``simulate_crashes=N`` makes the handler fail right after its first command
for the first ``N`` events it sees (once each), as a worker dying at the
worst moment would: the demo and the tests use it to show that the
redelivery changes nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from aggregates import AggregateNotFoundError, CommandResult, DomainError, Repository
from eventstore import EventStore, RecordedEvent
from projections import Reactor, ReactorWorker

from .account import Account
from .events import TransferDebited, TransferRequested
from .transfer import Transfer

__all__ = ["ProcessStats", "SimulatedCrash", "TransferProcess"]


class SimulatedCrash(RuntimeError):
    """Raised by the handler after its first command, to provoke a redelivery (``simulate_crashes``)."""


@dataclass
class ProcessStats:
    """What the process manager did in this process (a redelivered event is counted again)."""

    commands: int = 0
    """Commands issued (debits, credits, paybacks, transfer steps)."""
    duplicates: int = 0
    """Commands that had already been stored by an earlier delivery: nothing new was stored."""
    crashes: int = 0
    """Simulated crashes (each one causes a redelivery)."""
    skipped: int = 0
    """Deliveries of a step already decided (the transfer had moved on)."""


class TransferProcess:
    """The transfer process manager on one event-store connection: its :class:`~projections.Reactor` and repositories.

    Run it with :meth:`worker` (any number of workers, in any processes, share
    the reactor's durable consumer, named :attr:`NAME` unless ``name`` says
    otherwise). ``retry_backoff_s`` and ``ack_wait_s`` go to the reactor.
    """

    NAME = "transfer-process"

    def __init__(
        self,
        store: EventStore,
        *,
        name: str = NAME,
        simulate_crashes: int = 0,
        retry_backoff_s: Sequence[float] = (0.1, 1.0, 5.0),
        ack_wait_s: float = 30.0,
    ) -> None:
        self.accounts = Repository(store, Account)
        self.transfers = Repository(store, Transfer)
        self.stats = ProcessStats()
        self._crashes_left = simulate_crashes
        self._crashed: set[str] = set()
        self.store = store
        self.reactor = Reactor(
            name,
            handlers={TransferRequested: self._on_requested, TransferDebited: self._on_debited},
            categories=[Transfer.category],
            retry_backoff_s=retry_backoff_s,
            ack_wait_s=ack_wait_s,
            description="debits, credits and settles requested transfers",
        )

    def worker(self, *, concurrency: int = 16, until_idle: bool = False) -> ReactorWorker:
        """A worker running the reactor on this connection (``until_idle``: return once nothing is pending)."""
        return ReactorWorker(self.store, self.reactor, concurrency=concurrency, until_idle=until_idle)

    # -- handlers -------------------------------------------------------------

    async def _on_requested(self, event: RecordedEvent) -> None:
        request = event.data
        assert isinstance(request, TransferRequested)
        transfer_id = event.stream_id.entity_id
        if (await self.transfers.get(transfer_id)).state.status != "requested":
            self.stats.skipped += 1  # a redelivery after this step was decided
            return
        key = self.reactor.idempotency_key
        try:
            await self._count(self.accounts.execute(
                request.from_account,
                lambda a: a.send(transfer_id, request.to_account, request.amount, request.value_date),
                command_id=key(event, "debit"), correlation_id=transfer_id,
            ))
        except (DomainError, AggregateNotFoundError) as refused:
            await self._count(self.transfers.execute(
                transfer_id, lambda t: t.fail(f"debit refused: {refused}", refunded=False),
                command_id=key(event, "fail"), correlation_id=transfer_id,
            ))
            return
        self._maybe_crash(event)
        await self._count(self.transfers.execute(
            transfer_id, lambda t: t.mark_debited(), command_id=key(event, "debited"), correlation_id=transfer_id,
        ))

    async def _on_debited(self, event: RecordedEvent) -> None:
        transfer_id = event.stream_id.entity_id
        transfer = (await self.transfers.get(transfer_id)).state
        if transfer.status != "debited":
            self.stats.skipped += 1
            return
        key = self.reactor.idempotency_key
        try:
            await self._count(self.accounts.execute(
                transfer.to_account,
                lambda a: a.receive(transfer_id, transfer.from_account, transfer.amount, transfer.value_date),
                command_id=key(event, "credit"), correlation_id=transfer_id,
            ))
        except (DomainError, AggregateNotFoundError) as refused:
            # Compensate: the money left the source account, so it goes back before the transfer fails.
            await self._count(self.accounts.execute(
                transfer.from_account, lambda a: a.pay_back(transfer_id, transfer.amount, transfer.value_date),
                command_id=key(event, "pay-back"), correlation_id=transfer_id,
            ))
            self._maybe_crash(event)
            await self._count(self.transfers.execute(
                transfer_id, lambda t: t.fail(f"credit refused: {refused}", refunded=True),
                command_id=key(event, "fail"), correlation_id=transfer_id,
            ))
            return
        self._maybe_crash(event)
        await self._count(self.transfers.execute(
            transfer_id, lambda t: t.complete(), command_id=key(event, "complete"), correlation_id=transfer_id,
        ))

    # -- helpers --------------------------------------------------------------

    async def _count(self, command: Awaitable[CommandResult[Any]]) -> None:
        result = await command
        self.stats.commands += 1
        if result.duplicate:
            self.stats.duplicates += 1

    def _maybe_crash(self, event: RecordedEvent) -> None:
        if self._crashes_left > 0 and event.event_id not in self._crashed:
            self._crashes_left -= 1
            self._crashed.add(event.event_id)
            self.stats.crashes += 1
            raise SimulatedCrash(
                f"simulated crash after the first command for {event.type} of {event.stream_id}, before the ack"
            )

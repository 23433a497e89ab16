"""A projection that leaves behind a task which ignores cancellation: the shutdown tests' worst case.

Such a task (a library's, a handler's) keeps ``asyncio.run`` waiting at exit
forever; the CLI must still end. Run with ``tests/projections`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio

from eventstore import RecordedEvent
from projections import Transaction, handles

from projection_examples import AccountBalances, Deposited

_stubborn: set[asyncio.Task[None]] = set()


async def _ignore_cancellation() -> None:
    while True:
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            pass  # the defect under test: a cancellation lost, as asyncio.wait_for can on 3.11


class StubbornBalances(AccountBalances):
    """AccountBalances whose first deposit starts a task that never ends."""

    name = "stubborn_balances"

    @handles(Deposited)
    def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
        super().deposited(event, tx)
        if not _stubborn:
            _stubborn.add(asyncio.get_running_loop().create_task(_ignore_cancellation()))

"""A projection that leaves behind a task which ignores cancellation: the shutdown tests' worst case.

Such a task (a library's, a handler's) keeps ``asyncio.run`` waiting at exit
forever; the CLI must still end. Run with ``tests/projections`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio
import contextlib

from eventstore import RecordedEvent, TypeRegistry
from projections import Transaction, handles

from projection_examples import AccountBalances, Deposited

_stubborn: set[asyncio.Task[None]] = set()
_started: list[bool] = []


async def _ignore_cancellation() -> None:
    while True:
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            pass  # the defect under test: a cancellation lost, as asyncio.wait_for can on 3.11


class StubbornBalances(AccountBalances):
    """AccountBalances whose first deposit starts a task that never ends."""

    name = "stubborn_balances"

    def bind(self, registry: TypeRegistry | None) -> None:
        with contextlib.suppress(RuntimeError):  # the CLI binds once outside any loop, to check the projection
            self.loop = asyncio.get_running_loop()  # the daemon binds on its loop; handlers run in the store's thread
        super().bind(registry)

    @handles(Deposited)
    def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
        super().deposited(event, tx)
        if not _started:
            _started.append(True)
            self.loop.call_soon_threadsafe(lambda: _stubborn.add(self.loop.create_task(_ignore_cancellation())))

"""A command-service worker process for the queue-group tests: ``python -m tests.aggregates.service_worker
NATS_URL STREAM SUBJECT_PREFIX COMMAND_PREFIX``. Prints "ready" once subscribed; SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import signal
import sys

from aggregates import CommandService, Repository
from eventstore import EventStore, EventStoreSettings

from .commands import Deposit, Open
from .domain import Account


async def main(nats_url: str, stream: str, subject_prefix: str, command_prefix: str) -> None:
    store = await EventStore.connect(EventStoreSettings(nats_url=nats_url, stream=stream, subject_prefix=subject_prefix))
    accounts = Repository(store, Account)
    service = CommandService(store, subject_prefix=command_prefix, drain_timeout_s=5)
    service.add(accounts, Open, lambda a, c: a.open(c.owner), create=True)

    @service.command(accounts, Deposit)
    async def deposit(account: Account, command: Deposit) -> int:
        await asyncio.sleep(0.005)  # so that a killed worker has commands in flight
        return account.deposit(command.amount)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with service:
        print("ready", flush=True)
        await stop.wait()
    await store.close()


def not_a_service(store: EventStore, **options: object) -> str:
    """A factory that returns no service, for the CLI's error test."""
    return "not a service"


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))

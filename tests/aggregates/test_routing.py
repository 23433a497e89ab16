"""Command routing: one aggregate's commands reach one warm worker, and the partitions move by themselves."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import sys
import time
import uuid
import zlib
from typing import Any

import nats
import pytest

from aggregates import CommandClient, CommandService, CommandUnavailableError, Repository, partition_of
from aggregates.membership import PARTITIONS_KEY, routing_bucket
from aggregates.routing import LOAD_BOUND, assign, check_partitions
from eventstore import EventStore, InvalidArgumentError
from tests.conftest import unique_settings
from tests.support.proxy import Proxy

from .commands import Deposit, Open
from .domain import Account


def test_an_ids_partition_is_crc32_of_its_utf8_bytes() -> None:
    """The function other languages' clients implement: zlib's CRC-32 of the id's UTF-8, modulo the count."""
    assert partition_of("123456789", 1 << 32) == 0xCBF43926  # CRC-32's published check value
    assert partition_of("alice", 64) == zlib.crc32(b"alice") % 64
    assert partition_of("é", 7) == zlib.crc32("é".encode()) % 7
    assert {partition_of(f"id{i}", 16) for i in range(1000)} == set(range(16))


def test_the_assignment_is_the_same_from_every_workers_view_and_covers_each_partition_once() -> None:
    members = [f"w{i}" for i in range(7)]
    one = assign(members, 500)
    assert one == assign(reversed(members), 500) == assign([*members, "w3"], 500)
    assert sorted(p for parts in one.values() for p in parts) == list(range(500))
    assert max(len(parts) for parts in one.values()) <= -(-LOAD_BOUND * 500 // 7)
    assert assign([], 10) == {} and assign(["solo"], 3) == {"solo": frozenset({0, 1, 2})}


def test_a_leave_moves_the_leavers_partitions_and_few_others() -> None:
    members = [f"w{i}" for i in range(10)]
    before = {p: m for m, parts in assign(members, 1000).items() for p in parts}
    after = {p: m for m, parts in assign(members[1:], 1000).items() for p in parts}
    moved = [p for p in before if before[p] != after[p]]
    assert {p for p in before if before[p] == "w0"} <= set(moved)
    assert len(moved) < 1000 * 0.15  # the leaver held about a tenth


@pytest.mark.parametrize("partitions", [0, -1, 65_537, 2.0, "64", True, None])
def test_a_partition_count_out_of_range_is_refused(partitions: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="partitions must be an int from 1 to 65,536"):
        check_partitions(partitions)


def service(store: EventStore, prefix: str, handled: list[str] | None = None, **options: Any) -> CommandService:
    accounts = Repository(store, Account)
    built = CommandService(store, subject_prefix=prefix, member_ttl_s=0.9, **options)
    built.add(accounts, Open, lambda a, c: a.open(c.owner), create=True)

    def deposit(account: Account, command: Deposit) -> int:
        if handled is not None:
            handled.append(account.id)
        return account.deposit(command.amount)

    built.add(accounts, Deposit, deposit)
    return built


async def settled(services: list[CommandService], partitions: int, timeout_s: float = 15.0) -> None:
    """Until the services own every partition once between them, and have released the partitions they gave up."""
    deadline = time.monotonic() + timeout_s
    while True:
        owned = [p for s in services for p in s.owned_partitions.get("Account", ())]
        if sorted(owned) == list(range(partitions)) and not any(s._releasing for s in services):
            return
        assert time.monotonic() < deadline, f"not settled: {sorted(owned)}"
        await asyncio.sleep(0.05)


async def test_each_aggregates_commands_reach_one_worker_whose_cache_stays_current(nats_url: str) -> None:
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    settings = unique_settings(nats_url)  # the events' stream; commands travel on ``prefix``
    stores = [await EventStore.connect(settings) for _ in range(3)]
    handled: list[list[str]] = [[], [], []]
    services = [service(store, prefix, handled[n], partitions=16) for n, store in enumerate(stores)]
    try:
        for s in services:
            await s.start()
        await settled(services, 16)
        client = CommandClient(stores[0], subject_prefix=prefix)
        ids = [f"acct{i}" for i in range(24)]
        await asyncio.gather(*(client.send(Account, i, Open(owner=i)) for i in ids))
        await asyncio.gather(*(client.send(Account, ids[n % 24], Deposit(amount=1)) for n in range(480)))
        # every aggregate's deposits ran on one worker only: the one owning its partition
        for n, s in enumerate(services):
            mine = s.owned_partitions["Account"]
            assert all(partition_of(i, 16) in mine for i in handled[n]), n
        assert sum(len(h) for h in handled) == 480
        stats = [next(iter({id(r.repository): r.repository for r in s._routes.values()}.values())).cache_stats
                 for s in services]
        assert sum(st.stale for st in stats) == 0
        assert sum(st.hits for st in stats) >= 480  # the opens loaded (missed); every deposit found its copy current
        assert [(await Repository(stores[0], Account).get(i)).state.balance for i in ids] == [20] * 24
    finally:
        for s in services:
            await s.stop()
        for store in stores:
            await store.close()


async def test_partitions_move_to_the_others_when_a_worker_stops_and_back_when_one_joins(nats_url: str) -> None:
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    settings = unique_settings(nats_url)
    stores = [await EventStore.connect(settings) for _ in range(3)]
    services = [service(store, prefix, partitions=32) for store in stores]
    try:
        for s in services[:2]:
            await s.start()
        await settled(services[:2], 32)
        await services[2].start()
        await settled(services, 32)
        assert all(s.owned_partitions["Account"] for s in services)
        await services[0].stop()
        await settled(services[1:], 32)
    finally:
        for s in services:
            await s.stop()
        for store in stores:
            await store.close()


async def test_a_service_with_another_partition_count_than_the_live_ones_refuses_to_start(nats_url: str) -> None:
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    async with EventStore.connect(unique_settings(nats_url)) as store:
        async with service(store, prefix, partitions=8):
            other = service(store, prefix, partitions=9)
            with pytest.raises(InvalidArgumentError, match="route 8 partitions, this one 9"):
                await other.start()
            assert other.subjects and not other._subs  # nothing left subscribed


async def test_a_command_whose_partition_nobody_serves_goes_to_the_plain_subject(nats_url: str) -> None:
    """A client that routes to a partition without a worker (here: the bucket says 1,000 partitions, the
    worker serves 4) is answered through the plain subject every worker serves, exactly once."""
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    async with EventStore.connect(unique_settings(nats_url)) as store:
        async with service(store, prefix, partitions=4) as served:
            kv = await store.nc.jetstream().key_value(routing_bucket(prefix))
            served._membership._beats.cancel()  # type: ignore[union-attr]  # keep the forged count in place
            await kv.put(PARTITIONS_KEY, b"1000")
            client = CommandClient(store, subject_prefix=prefix)
            await client.send(Account, "far", Open(owner="far"))
            reply = await client.send(Account, "far", Deposit(amount=3), command_id="far-1")
            assert (reply.version, reply.duplicate) == (2, False)
            assert (await client.send(Account, "far", Deposit(amount=3), command_id="far-1")).duplicate


async def test_without_routing_services_a_client_sends_on_the_plain_subjects(nats_url: str) -> None:
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    async with EventStore.connect(unique_settings(nats_url)) as store:
        async with service(store, prefix, routing=False) as served:
            assert served.owned_partitions == {}
            client = CommandClient(store, subject_prefix=prefix)
            await client.send(Account, "plain", Open(owner="p"))
            assert (await client.send(Account, "plain", Deposit(amount=1))).version == 2


async def test_worker_churn_with_routing_stores_each_command_id_once_and_every_call_ends(nats_url: str) -> None:
    """Three worker processes; every 1-2 s one is SIGKILLed and a new one started. Four clients resend each
    unanswered command with its id: every deposit is stored exactly once, and every send ends in its timeout."""
    settings = unique_settings(nats_url)
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    rng = random.Random(29)

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.aggregates.service_worker", nats_url, settings.stream,
             settings.subject_prefix, prefix], stdout=subprocess.PIPE, text=True,
        )

    async with EventStore.connect(settings) as store:
        workers = [start() for _ in range(3)]
        try:
            for worker in workers:
                assert worker.stdout is not None and await asyncio.to_thread(worker.stdout.readline) == "ready\n"
            ids = [f"c{i}" for i in range(12)]
            opener = CommandClient(store, subject_prefix=prefix, timeout_s=3)
            await asyncio.gather(*(opener.send(Account, i, Open(owner=i)) for i in ids))
            clients = [CommandClient(store, subject_prefix=prefix, timeout_s=1.5) for _ in range(4)]
            issued: list[int] = []
            kills = 0
            stopping = asyncio.Event()

            async def deposits(c: int) -> None:
                # Sends for as long as the churn lasts (five kills at least), whatever the machine's speed.
                n = c
                while kills < 5 or n < 400:
                    issued.append(n)
                    for attempt in range(40):
                        started = time.monotonic()
                        try:
                            await clients[c].send(Account, ids[n % 12], Deposit(amount=1), command_id=f"d{n}")
                            break
                        except CommandUnavailableError:
                            assert time.monotonic() - started < 1.5 + 2.0  # every call ends within its timeout
                    else:
                        raise AssertionError(f"d{n} never answered")
                    n += 4

            async def churn() -> None:
                nonlocal kills
                while not stopping.is_set():
                    await asyncio.sleep(rng.uniform(1.0, 2.0))
                    victim = workers.pop(rng.randrange(len(workers)))
                    victim.kill()
                    await asyncio.to_thread(victim.wait)
                    kills += 1
                    workers.append(start())

            churning = asyncio.create_task(churn())
            try:
                await asyncio.gather(*(deposits(c) for c in range(4)))
            finally:
                stopping.set()
                await churning
            assert kills >= 5
            keys = [e.idempotency_key async for batch in store.read_all() for e in batch if e.type == "Deposited"]
            assert sorted(keys) == sorted(f"d{n}" for n in issued)  # each command id once, none lost
            balances = [(await Repository(store, Account).get(i)).state.balance for i in ids]
            assert balances == [sum(1 for n in issued if n % 12 == i) for i in range(12)]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.send_signal(signal.SIGTERM)
            for worker in workers:
                try:
                    worker.wait(10)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()


async def test_a_send_ends_within_its_timeout_while_it_reads_the_partition_count(nats_url: str) -> None:
    """The first send reads the partition count; over a slow link (0.4 s each way) that read and the request
    still end within the send's one timeout, answered or not."""
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    async with EventStore.connect(unique_settings(nats_url)) as store, service(store, prefix):
        async with Proxy(nats_url) as proxy:
            nc = await nats.connect(proxy.url)
            try:
                proxy.delay(0.4)
                client = CommandClient(nc, subject_prefix=prefix, timeout_s=1.0)
                started = time.monotonic()
                with contextlib.suppress(CommandUnavailableError):
                    await client.send(Account, "slow", Open(owner="s"))
                assert time.monotonic() - started < 1.0 + 0.5
            finally:
                proxy.delay(0.0)
                await nc.close()

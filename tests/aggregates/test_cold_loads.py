"""Cold loads of aggregates spread through the stream, with and without snapshots and the cache."""

from __future__ import annotations

from typing import Any

from aggregates import Repository
from eventstore import EventStore, StreamId
from tests.conftest import unique_settings
from tests.support.noise import noise

from .domain import Account, InsufficientFunds


async def spread_out(repo: Repository[Account], store: EventStore, account_id: str, commits: int) -> None:
    await repo.execute(account_id, lambda a: a.open("Owner"), create=True)
    for i in range(commits - 1):
        await noise(store)
        await repo.execute(account_id, lambda a: a.deposit(10 + i % 3))


async def test_a_spread_out_aggregate_loads_equal_with_snapshots_of_any_schema(store: EventStore) -> None:
    await spread_out(Repository(store, Account), store, "far", 14)
    full = await Repository(store, Account, cache_size=0).get("far")
    snapped = Repository(store, Account, cache_size=0, snapshot_every=5)
    for _ in range(2):  # the first load writes the snapshot, the second reads it and the tail after it
        loaded = await snapped.get("far")
        assert (loaded.version, loaded.position, loaded.state) == (full.version, full.position, full.state)
    await noise(store)
    await Repository(store, Account).execute("far", lambda a: a.deposit(5))
    await noise(store)
    full = await Repository(store, Account, cache_size=0).get("far")
    newer_schema = Repository(store, Account, cache_size=0, snapshot_every=5, snapshot_version=2)
    for repo in (snapped, newer_schema):  # a tail after the snapshot; a snapshot of an older schema (ignored)
        loaded = await repo.get("far")
        assert (loaded.version, loaded.position, loaded.state) == (full.version, full.position, full.state)
    past = await snapped.get("far", version=9)
    assert past.state.balance == sum(10 + i % 3 for i in range(8))


async def test_a_command_on_a_cached_aggregate_sends_only_the_append(store: EventStore) -> None:
    accounts = Repository(store, Account)
    await spread_out(accounts, store, "cached", 3)
    sent = store.nc.stats["out_msgs"]
    await accounts.execute("cached", lambda a: a.deposit(1))
    assert store.nc.stats["out_msgs"] - sent == 1
    # Another writer moves it: the conflict reloads from the cached position, and the command runs again.
    await Repository(store, Account, cache_size=0).execute("cached", lambda a: a.deposit(100))
    result = await accounts.execute("cached", lambda a: a.deposit(1))
    assert (await Repository(store, Account, cache_size=0).get("cached")).version == result.version == 6


async def test_the_same_commands_with_and_without_the_cache_give_the_same_streams(nats_url: str) -> None:
    streams: list[list[Any]] = []
    for cache_size in (1000, 0):
        async with EventStore.connect(unique_settings(nats_url)) as store:
            repo = Repository(store, Account, cache_size=cache_size)
            other = Repository(store, Account, cache_size=0)  # another writer, between the commands
            for step in range(40):
                account_id = f"a{step % 4}"
                if step < 4:
                    await repo.execute(account_id, lambda a: a.open("Owner"), create=True)
                    continue
                if step % 7 == 0:
                    await other.execute(account_id, lambda a: a.deposit(7))
                try:
                    await repo.execute(account_id, lambda a, s=step: a.withdraw(s) if s % 3 == 0 else a.deposit(s),
                                       command_id=f"{account_id}-cmd-{step % 20}")  # some repeat
                except InsufficientFunds:
                    pass
            streams.append([
                [(e.type, e.data, e.version) for e in await store.read(StreamId("Account", f"a{i}"))] for i in range(4)
            ])
    assert streams[0] == streams[1]
    assert sum(len(s) for s in streams[0]) > 25  # refusals and repeated ids stored nothing

"""Repositories never build an aggregate on a history with a hole: full replays, snapshot + tail, cached copies."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from aggregates import Repository
from eventstore import EventStore, EventStoreSettings, HistoryGapError

from tests.support.damage import damageable_store

from .domain import Account


@pytest.fixture
async def store(settings: EventStoreSettings) -> AsyncIterator[EventStore]:
    store = await damageable_store(settings)
    try:
        yield store
    finally:
        await store.close()


async def account(repo: Repository[Account], deposits: int) -> tuple[str, list[int]]:
    """A new open account with ``deposits`` deposits of 1, one command each; the positions of its commits."""
    account_id = uuid.uuid4().hex[:12]
    positions = [(await repo.execute(account_id, lambda a: a.open("Owner"), create=True)).position]
    for _ in range(deposits):
        positions.append((await repo.execute(account_id, lambda a: a.deposit(1))).position)
    return account_id, positions


async def delete(store: EventStore, position: int) -> None:
    assert await store.nc.jetstream().delete_msg(store.settings.stream, position)


async def test_get_and_execute_on_a_damaged_account_raise_and_store_nothing(store: EventStore) -> None:
    account_id, positions = await account(Repository(store, Account), 11)
    await delete(store, positions[5])  # version 6, a deposit
    repo = Repository(store, Account)  # no cached copy
    with pytest.raises(HistoryGapError, match="version 6 is missing") as caught:
        await repo.get(account_id)
    assert caught.value.version == 6
    with pytest.raises(HistoryGapError):
        await repo.execute(account_id, lambda a: a.deposit(1))
    for version in (8, 5):  # time travel too: a load reads the entity's history up to its last commit
        with pytest.raises(HistoryGapError):
            await repo.get(account_id, version=version)
    assert (await store.info()).last_position == positions[-1]  # nothing was appended


async def test_a_hole_in_the_tail_after_a_snapshot_is_raised(store: EventStore) -> None:
    account_id, positions = await account(Repository(store, Account, snapshot_every=5), 11)  # snapshots at 5, 10
    await delete(store, positions[10])  # version 11, after the snapshot at version 10
    with pytest.raises(HistoryGapError, match="version 11"):
        await Repository(store, Account, snapshot_every=5).get(account_id)


async def test_a_hole_after_a_cached_copy_is_raised(store: EventStore) -> None:
    repo = Repository(store, Account)
    account_id, _ = await account(repo, 4)
    assert (await repo.get(account_id)).version == 5  # cached at version 5
    other = Repository(store, Account, cache_size=0)
    later = [(await other.execute(account_id, lambda a: a.deposit(1))).position for _ in range(3)]
    await delete(store, later[0])  # version 6: the cached copy fast-forwards from it
    with pytest.raises(HistoryGapError, match="version 6"):
        await repo.get(account_id)

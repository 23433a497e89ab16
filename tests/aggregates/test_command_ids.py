"""A command id holds at any age, compares exactly, and survives lost acknowledgements."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from aggregates import CommandResult, Repository
from aggregates.snapshots import SnapshotStore, bucket_name
from eventstore import EventStore, EventStoreSettings, InvalidArgumentError, ServerUnavailableError
from tests.conftest import unique_settings
from tests.support.proxy import Proxy

from .domain import Account, AccountState, InsufficientFunds

WINDOW_S = 1.0


async def _deposits(store: EventStore, repo: Repository[Account]) -> list[int]:
    events = await store.read(repo.aggregate_type._stream_id("alice"))
    return [e.data.amount for e in events[1:]]  # type: ignore[attr-defined]


@pytest.mark.parametrize("load", ["cached", "replayed", "snapshot"])
async def test_a_command_id_holds_after_the_duplicate_window(nats_url: str, load: str) -> None:
    settings = unique_settings(nats_url, duplicate_window_s=WINDOW_S)
    async with EventStore.connect(settings) as store:
        first_repo = Repository(store, Account, snapshot_every=1 if load == "snapshot" else None)
        await first_repo.execute("alice", lambda a: a.open("Alice"), create=True)
        first = await first_repo.execute("alice", lambda a: a.deposit(10), command_id="cmd-1")
        await first_repo.execute("alice", lambda a: a.deposit(5), command_id="cmd-2")
        await asyncio.sleep(WINDOW_S * 1.5)  # the server has forgotten the msg ids
        repo = first_repo if load == "cached" else Repository(store, Account, snapshot_every=first_repo._snapshots and 1)
        ran = []
        again = await repo.execute("alice", lambda a: ran.append(a.deposit(10)), command_id="cmd-1")
        assert again == CommandResult(None, first.version, first.position, duplicate=True)
        assert ran == []  # the command did not run again
        assert await _deposits(store, repo) == [10, 5]


async def test_command_ids_compare_exactly(store: EventStore) -> None:
    accounts = Repository(store, Account)
    await accounts.execute("alice", lambda a: a.open("Alice"), create=True)
    await accounts.execute("alice", lambda a: a.deposit(1), command_id="order-7:1")
    with pytest.raises(InsufficientFunds):  # a refusal is a refusal, not the success of "order-7:1"
        await Repository(store, Account).execute("alice", lambda a: a.withdraw(1000), command_id="order-7")
    other = await accounts.execute("alice", lambda a: a.deposit(2), command_id="order-7")
    assert not other.duplicate
    with pytest.raises(InsufficientFunds):
        await Repository(store, Account).execute("alice", lambda a: a.withdraw(1000), command_id="order-7:")
    assert await _deposits(store, accounts) == [1, 2]


async def test_after_a_lost_ack_a_retried_command_returns_the_first_run(nats_url: str) -> None:
    async with Proxy(nats_url) as proxy:
        settings: EventStoreSettings = unique_settings(proxy.url, request_timeout_s=0.5, append_retries=0)
        async with EventStore.connect(settings) as store:
            accounts = Repository(store, Account)
            await accounts.execute("alice", lambda a: a.open("Alice"), create=True)
            proxy.dropping_all = True
            with pytest.raises(ServerUnavailableError, match="may or may not be stored"):
                await accounts.execute("alice", lambda a: a.deposit(10), command_id="cmd-1")
            proxy.dropping_all = False
            again = await accounts.execute("alice", lambda a: a.deposit(10), command_id="cmd-1")
            assert (again.version, again.duplicate) == (2, True)
            fresh = await Repository(store, Account).execute("alice", lambda a: a.deposit(10), command_id="cmd-1")
            assert (fresh.version, fresh.duplicate) == (2, True)
            assert await _deposits(store, accounts) == [10]


@hsettings(max_examples=25, deadline=None)
@given(command_id=st.text(st.characters(codec=None, exclude_categories=()), max_size=10))
async def test_any_command_id_runs_once_or_is_refused_before_running(nats_url: str, command_id: str) -> None:
    async with EventStore.connect(unique_settings(nats_url)) as store:  # ids are per stream
        accounts = Repository(store, Account)
        await accounts.execute("alice", lambda a: a.open("Alice"), create=True)
        ran: list[int] = []
        results = []
        for _ in range(2):
            try:
                results.append(
                    await accounts.execute("alice", lambda a: ran.append(a.deposit(10)), command_id=command_id)
                )
            except InvalidArgumentError as exc:
                assert command_id == "" and "command_id" in str(exc) and not ran
        if command_id == "":
            assert await _deposits(store, accounts) == []
            return
        assert len(ran) == 1 and [r.duplicate for r in results] == [False, True]
        assert results[0].version == results[1].version == 2
        events = await store.read(accounts.aggregate_type._stream_id("alice"))
        assert events[-1].idempotency_key == command_id
        assert await _deposits(store, accounts) == [10]


async def test_a_snapshot_without_command_ids_is_not_used(nats_url: str) -> None:
    """A snapshot written before snapshots kept command ids would forget them: a full replay is used instead."""
    settings = unique_settings(nats_url, duplicate_window_s=WINDOW_S)
    async with EventStore.connect(settings) as store:
        accounts = Repository(store, Account, snapshot_every=1)
        await accounts.execute("alice", lambda a: a.open("Alice"), create=True)
        first = await accounts.execute("alice", lambda a: a.deposit(10), command_id="cmd-1")
        snapshots = SnapshotStore(store, "Account", AccountState, every=1)
        kv = await store.nc.jetstream().key_value(bucket_name(settings.stream))
        old = {"fingerprint": snapshots.fingerprint, "version": first.version, "position": first.position,
               "state": AccountState(owner="Alice", balance=10, open=True).model_dump(mode="json")}
        await kv.put("Account.alice", json.dumps(old).encode())
        assert await snapshots.get("alice") is None
        await asyncio.sleep(WINDOW_S * 1.5)
        again = await Repository(store, Account, snapshot_every=1).execute(
            "alice", lambda a: a.deposit(10), command_id="cmd-1"
        )
        assert (again.version, again.duplicate) == (first.version, True)
        assert await _deposits(store, accounts) == [10]

"""Snapshots: loads from a snapshot equal full replays, read only the tail, and never change a result."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from nats.js.kv import KeyValue
from pydantic import BaseModel

from aggregates import Aggregate, DomainEvent, Repository, applies
from aggregates.snapshots import SnapshotStore, bucket_name
from eventstore import EventStore, RecordedEvent

from .domain import Account, AccountState


class ReadSpy:
    """Counts the events ``store.read`` returns."""

    def __init__(self, store: EventStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events = 0
        original = store.read

        async def read(*args: Any, **kwargs: Any) -> list[RecordedEvent]:
            events = await original(*args, **kwargs)
            self.events += len(events)
            return events

        monkeypatch.setattr(store, "read", read)

    def take(self) -> int:
        count, self.events = self.events, 0
        return count


@pytest.fixture
def spy(store: EventStore, monkeypatch: pytest.MonkeyPatch) -> ReadSpy:
    return ReadSpy(store, monkeypatch)


def deposits(n: int) -> Any:
    return lambda a: [a.deposit(1) for _ in range(n)]


async def grow(repo: Repository[Account], account_id: str, events: int) -> None:
    """Open the account and deposit until it has ``events`` events, 100 per commit."""
    await repo.execute(account_id, lambda a: a.open("Owner"), create=True)
    left = events - 1
    while left:
        batch = min(100, left)
        await repo.execute(account_id, deposits(batch))
        left -= batch


async def test_snapshot_loads_equal_full_replays_and_read_only_the_tail(store: EventStore, spy: ReadSpy) -> None:
    writer = Repository(store, Account)
    plain = Repository(store, Account, cache_size=0)
    snapped = Repository(store, Account, snapshot_every=1000, cache_size=0)
    await grow(writer, "big", 10_000)
    await writer.execute("other", lambda a: a.open("Other"), create=True)  # interleave another aggregate
    spy.take()

    full = await plain.get("big")
    assert (full.version, full.state.balance, spy.take()) == (10_000, 9_999, 10_000)
    first = await snapped.get("big")  # no snapshot yet: a full replay, which writes one
    assert spy.take() == 10_000
    assert (first.version, first.position, first.state) == (full.version, full.position, full.state)
    again = await snapped.get("big")
    # Only the snapshot's own commit (the last 99 deposits), read to check the snapshot lines up with the stream.
    assert spy.take() == 99
    assert (again.version, again.position, again.state) == (full.version, full.position, full.state)

    await writer.execute("big", deposits(37))  # 37 events the snapshot does not have
    await writer.execute("other", deposits(5))
    spy.take()
    full = await plain.get("big")
    assert spy.take() == 10_037
    tail = await snapped.get("big")
    assert spy.take() == 99 + 37
    assert (tail.version, tail.position, tail.state) == (full.version, full.position, full.state)

    past = await snapped.get("big", version=10_010)  # time travel starts from the snapshot too
    assert (spy.take(), past.version, past.state.balance) == (99 + 10, 10_010, 10_009)
    early = await snapped.get("big", version=500)  # before the snapshot: from the start
    assert (spy.take(), early.version, early.state.balance) == (500, 500, 499)


async def test_saving_across_a_multiple_of_n_writes_a_snapshot(store: EventStore, spy: ReadSpy) -> None:
    snapped = Repository(store, Account, snapshot_every=10, cache_size=0)
    await snapped.execute("a", lambda a: a.open("A"), create=True)
    await snapped.execute("a", deposits(8))  # version 9: no snapshot yet
    spy.take()
    await snapped.get("a")
    assert spy.take() == 9
    await snapped.execute("a", deposits(3))  # version 12 crosses 10: snapshot at 12
    await snapped.execute("a", deposits(2))  # version 14
    spy.take()
    loaded = await snapped.get("a")
    assert (spy.take(), loaded.version, loaded.state.balance) == (3 + 2, 14, 13)  # the snapshot's commit, the tail


async def test_a_save_continues_from_a_snapshot_load(store: EventStore, spy: ReadSpy) -> None:
    snapped = Repository(store, Account, snapshot_every=5, cache_size=0)
    await snapped.execute("a", lambda a: a.open("A"), create=True)
    await snapped.execute("a", deposits(5))
    spy.take()
    account = await snapped.get("a")
    assert spy.take() == 5  # the snapshot's own commit only
    account.deposit(1)
    await snapped.save(account)  # expected version and position come from the snapshot
    assert (await Repository(store, Account).get("a")).state.balance == 6


@pytest.mark.parametrize("account_id", ["alice@example.com", "β/γ δ.*>", "=x"])
async def test_any_id_can_be_snapshotted(store: EventStore, spy: ReadSpy, account_id: str) -> None:
    snapped = Repository(store, Account, snapshot_every=2, cache_size=0)
    await snapped.execute(account_id, lambda a: a.open("A"), create=True)
    await snapped.execute(account_id, deposits(2))
    spy.take()
    loaded = await snapped.get(account_id)
    assert (spy.take(), loaded.version, loaded.id) == (2, 3, account_id)  # the snapshot's own commit only


async def test_deleting_the_bucket_changes_no_result(store: EventStore, spy: ReadSpy) -> None:
    snapped = Repository(store, Account, snapshot_every=10, cache_size=0)
    await grow(snapped, "a", 25)  # snapshot at 25
    await Repository(store, Account).execute("a", deposits(5))  # a writer without snapshots
    spy.take()
    with_snapshot = await snapped.get("a")
    assert spy.take() == 24 + 5  # the snapshot's own commit, the tail
    await store.nc.jetstream().delete_key_value(bucket_name(store.settings.stream))
    without = await snapped.get("a")  # full replay (and the bucket comes back with a new snapshot)
    assert spy.take() == 30
    assert (without.version, without.position, without.state) == (
        with_snapshot.version, with_snapshot.position, with_snapshot.state
    )
    await snapped.get("a")
    assert spy.take() == 5


async def test_failing_snapshot_writes_never_fail_a_command(
    store: EventStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken_put(self: KeyValue, key: str, value: bytes, validate_keys: bool = True) -> int:
        raise OSError("disk on fire")

    monkeypatch.setattr(KeyValue, "put", broken_put)
    snapped = Repository(store, Account, snapshot_every=2, cache_size=0)
    with caplog.at_level(logging.WARNING, logger="jetsourcing.aggregates"):
        await snapped.execute("a", lambda a: a.open("A"), create=True)
        result = await snapped.execute("a", deposits(3))
    assert result.version == 4
    assert "Writing the snapshot of Account 'a' at version 4 failed: disk on fire" in caplog.text
    assert (await snapped.get("a")).state.balance == 3


async def test_failing_snapshot_reads_fall_back_to_a_full_replay(
    store: EventStore, spy: ReadSpy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    snapped = Repository(store, Account, snapshot_every=2, cache_size=0)
    await grow(snapped, "a", 5)

    async def broken_get(self: KeyValue, key: str, revision: int | None = None, validate_keys: bool = True) -> Any:
        raise TimeoutError("slow disk")

    monkeypatch.setattr(KeyValue, "get", broken_get)
    spy.take()
    with caplog.at_level(logging.WARNING, logger="jetsourcing.aggregates"):
        loaded = await snapped.get("a")
    assert (spy.take(), loaded.state.balance) == (5, 4)
    assert "replaying all events" in caplog.text


@pytest.mark.parametrize(
    "version, position",
    [(2, 0), (2, 2), (100, 2), (3, 99)],
    ids=["before-the-stream", "mid-commit", "from-a-longer-stream", "past-the-end"],
)
async def test_snapshots_that_do_not_line_up_with_the_stream_are_ignored(
    store: EventStore, version: int, position: int
) -> None:
    snapped = Repository(store, Account, snapshot_every=1000, cache_size=0)
    await grow(snapped, "a", 5)  # version 1 at position 1, versions 2-5 at position 2
    snapshots = SnapshotStore(store, "Account", AccountState, every=1000)
    await snapshots.put("a", version, position, AccountState(owner="Wrong", balance=1_000_000, open=True), {})
    loaded = await snapped.get("a")
    assert (loaded.version, loaded.position, loaded.state.balance, loaded.state.owner) == (5, 2, 4, "Owner")
    loaded.deposit(1)
    await snapped.save(loaded)
    assert (await Repository(store, Account).get("a")).version == 6


async def test_unreadable_snapshots_are_ignored(store: EventStore) -> None:
    snapped = Repository(store, Account, snapshot_every=2, cache_size=0)
    await grow(snapped, "a", 5)
    kv = await store.nc.jetstream().key_value(bucket_name(store.settings.stream))
    for garbage in (b"not json", b'{"fingerprint": 1}', b"{}"):
        await kv.put("Account.a", garbage)
        assert (await snapped.get("a")).state.balance == 4


# -- snapshots of an older schema -------------------------------------------------


class Added(DomainEvent):
    n: int


class CounterState(BaseModel):
    total: int = 0


class Counter(Aggregate[CounterState]):
    def add(self, n: int) -> None:
        self.record(Added(n=n))

    @applies(Added)
    def _added(self, event: Added) -> None:
        self.state.total += event.n


class CounterStateV2(BaseModel):
    total: int = 0
    count: int = 0


class CounterV2(Aggregate[CounterStateV2], category="Counter"):
    """The next release: the state gained a field."""

    @applies(Added)
    def _added(self, event: Added) -> None:
        self.state.total += event.n
        self.state.count += 1


class DoublingCounter(Aggregate[CounterState], category="Counter"):
    """The next release: same state model, new logic (so it bumps snapshot_version)."""

    @applies(Added)
    def _added(self, event: Added) -> None:
        self.state.total += 2 * event.n


async def write_counter(store: EventStore) -> None:
    old = Repository(store, Counter, snapshot_every=10, cache_size=0)
    await old.execute("c", lambda c: c.add(1), create=True)
    for _ in range(19):
        await old.execute("c", lambda c: c.add(1))  # 20 commits; snapshots at 10 and 20


async def test_a_snapshot_of_an_older_state_schema_is_ignored(store: EventStore, spy: ReadSpy) -> None:
    await write_counter(store)
    spy.take()
    new = await Repository(store, CounterV2, snapshot_every=10, cache_size=0).get("c")
    assert (spy.take(), new.state) == (20, CounterStateV2(total=20, count=20))  # not count=0 from the old snapshot
    assert (await Repository(store, CounterV2, snapshot_every=10, cache_size=0).get("c")).state.count == 20
    assert spy.take() == 1  # the full replay wrote a snapshot of the new schema


async def test_bumping_snapshot_version_ignores_older_snapshots(store: EventStore, spy: ReadSpy) -> None:
    await write_counter(store)
    spy.take()
    doubled = await Repository(store, DoublingCounter, snapshot_every=10, snapshot_version=2, cache_size=0).get("c")
    assert (spy.take(), doubled.state.total) == (20, 40)

"""Loading, saving and time travel against a real server."""

from __future__ import annotations

import pytest

from aggregates import AggregateNotFoundError, InvalidAggregateIdError, Repository
from eventstore import ConcurrencyError, EventStore, StreamId

from .domain import Account, AccountState, Cart, CartError, Order


async def open_account(accounts: Repository[Account], account_id: str, *deposits: int) -> Account:
    account = Account(account_id)
    account.open(account_id.title())
    for amount in deposits:
        account.deposit(amount)
    await accounts.save(account)
    return account


async def test_save_then_get_replays_the_same_state(accounts: Repository[Account], store: EventStore) -> None:
    saved = await open_account(accounts, "alice", 10, 20)
    assert (saved.version, saved.pending) == (3, ())
    assert saved.position == (await store.state(StreamId("Account", "alice"))).position
    fresh = Repository(store, Account)  # no cache: a real replay
    loaded = await fresh.get("alice")
    assert (loaded.version, loaded.position, loaded.state) == (3, saved.position, saved.state)
    assert loaded.state == AccountState(owner="Alice", balance=30, open=True)
    events = await store.read(StreamId("Account", "alice"))
    assert [e.type for e in events] == ["AccountOpened", "Deposited", "Deposited"]
    assert {e.position for e in events} == {saved.position}  # one save, one commit


async def test_get_of_an_unknown_id_raises_not_found(accounts: Repository[Account]) -> None:
    with pytest.raises(AggregateNotFoundError, match="Account 'nobody' does not exist") as info:
        await accounts.get("nobody")
    assert (info.value.aggregate, info.value.aggregate_id) == ("Account", "nobody")


@pytest.mark.parametrize("bad_id", ["", "nul\x00"])
async def test_get_with_an_illegal_id_raises(accounts: Repository[Account], bad_id: str) -> None:
    with pytest.raises(InvalidAggregateIdError):
        await accounts.get(bad_id)


async def test_saving_nothing_stores_nothing(accounts: Repository[Account], store: EventStore) -> None:
    account = await open_account(accounts, "alice", 5)
    before = await store.last_position()
    await accounts.save(account)
    await accounts.save_all([account])
    assert await store.last_position() == before


async def test_a_second_save_continues_from_the_first(accounts: Repository[Account], store: EventStore) -> None:
    account = await open_account(accounts, "alice", 5)
    account.deposit(1)
    await accounts.save(account)
    account.withdraw(6)
    await accounts.save(account)
    loaded = await Repository(store, Account).get("alice")
    assert (loaded.version, loaded.state.balance) == (4, 0)


async def test_time_travel(accounts: Repository[Account], store: EventStore) -> None:
    account = await open_account(accounts, "alice", 10)  # versions 1, 2 in one commit
    account.deposit(20)
    await accounts.save(account)  # version 3
    account.withdraw(5)
    await accounts.save(account)  # version 4
    for version, balance in [(1, 0), (2, 10), (3, 30), (4, 25)]:
        past = await accounts.get("alice", version=version)
        assert (past.version, past.state.balance) == (version, balance)
    with pytest.raises(AggregateNotFoundError, match="has no version 5: it has 4 events"):
        await accounts.get("alice", version=5)
    with pytest.raises(AggregateNotFoundError):
        await accounts.get("nobody", version=1)
    with pytest.raises(ValueError):
        await accounts.get("alice", version=0)


async def test_a_past_version_cannot_overwrite_the_present(accounts: Repository[Account], store: EventStore) -> None:
    await open_account(accounts, "alice", 10)  # versions 1 and 2 share one commit
    past = await accounts.get("alice", version=1)
    past.state.open = True  # (a test shortcut; domain code changes state only in handlers)
    past.deposit(1)
    before = await store.last_position()
    with pytest.raises(ConcurrencyError):
        await accounts.save(past)
    assert await store.last_position() == before
    latest = await accounts.get("alice", version=2)  # the current version: saving it is fine
    latest.deposit(1)
    await accounts.save(latest)
    assert (await Repository(store, Account).get("alice")).state.balance == 11


async def test_a_concurrent_change_raises_and_stores_nothing(accounts: Repository[Account], store: EventStore) -> None:
    await open_account(accounts, "alice", 10)
    mine, theirs = await accounts.get("alice"), await accounts.get("alice")
    theirs.deposit(1)
    await accounts.save(theirs)
    mine.withdraw(10)
    before = await store.last_position()
    with pytest.raises(ConcurrencyError) as info:
        await accounts.save(mine)
    assert (info.value.expected, info.value.actual) == (2, 3)
    assert await store.last_position() == before
    assert mine.pending  # kept: reload and run the command again
    assert (await Repository(store, Account).get("alice")).state.balance == 11


async def test_two_creates_of_one_id_conflict(accounts: Repository[Account]) -> None:
    first, second = Account("alice"), Account("alice")
    first.open("Alice")
    second.open("Alice")
    await accounts.save(first)
    with pytest.raises(ConcurrencyError):
        await accounts.save(second)


async def test_save_all_is_atomic(accounts: Repository[Account], store: EventStore) -> None:
    await open_account(accounts, "alice", 100)
    await open_account(accounts, "bob")
    alice, bob = await accounts.get("alice"), await accounts.get("bob")
    alice.withdraw(30)
    bob.deposit(30)
    await accounts.save_all([alice, bob], correlation_id="transfer-1")
    assert bob.position == alice.position + 1  # one atomic batch: one message per entity, back to back
    [withdrawn] = await store.read(StreamId("Account", "alice"), from_version=3)
    assert withdrawn.correlation_id == "transfer-1"
    fresh = Repository(store, Account)
    assert ((await fresh.get("alice")).state.balance, (await fresh.get("bob")).state.balance) == (70, 30)


async def test_save_all_with_one_conflict_stores_nothing(accounts: Repository[Account], store: EventStore) -> None:
    await open_account(accounts, "alice", 100)
    await open_account(accounts, "bob")
    alice, bob = await accounts.get("alice"), await accounts.get("bob")
    meddler = await accounts.get("bob")
    meddler.deposit(1)
    await accounts.save(meddler)
    alice.withdraw(30)
    bob.deposit(30)
    before = await store.last_position()
    with pytest.raises(ConcurrencyError):
        await accounts.save_all([alice, bob])
    assert await store.last_position() == before
    fresh = Repository(store, Account)
    assert ((await fresh.get("alice")).state.balance, (await fresh.get("bob")).state.balance) == (100, 1)


async def test_save_all_across_aggregate_types(
    carts: Repository[Cart], orders: Repository[Order], store: EventStore
) -> None:
    cart = Cart("c1")
    cart.create("carol")
    cart.add_item("apple", 3, 50)
    cart.add_item("pear", 1, 80)
    cart.add_item("apple", 1, 50)
    cart.remove_item("pear")
    await carts.save(cart)
    order = Order("o1")
    cart.check_out(order)
    await carts.save_all([cart, order])
    placed = await Repository(store, Order).get("o1")
    assert (placed.state.total, placed.state.status, placed.state.customer) == (200, "placed", "carol")
    with pytest.raises(CartError, match="already checked out"):
        (await carts.get("c1")).add_item("plum", 1, 10)
    placed.pay(200)
    placed.ship("DHL")
    await orders.save(placed)
    with pytest.raises(CartError, match="can no longer be cancelled"):
        (await orders.get("o1")).cancel("too late")


async def test_correlation_and_causation_ids_are_stored(accounts: Repository[Account], store: EventStore) -> None:
    account = Account("alice")
    account.open("Alice")
    await accounts.save(account, correlation_id="corr-1", causation_id="cause-1")
    [event] = await store.read(StreamId("Account", "alice"))
    assert (event.correlation_id, event.causation_id) == ("corr-1", "cause-1")
    assert event.metadata == {"correlation_id": "corr-1", "causation_id": "cause-1"}


async def test_the_cache_never_hides_other_writers(store: EventStore) -> None:
    here, elsewhere = Repository(store, Account), Repository(store, Account)
    await open_account(here, "alice", 10)
    assert (await here.get("alice")).state.balance == 10  # now cached here
    other = await elsewhere.get("alice")
    other.deposit(5)
    await elsewhere.save(other)
    assert (await here.get("alice")).state.balance == 15  # get() catches up with the store
    mine = await here.get("alice")
    mine.state.balance = 999  # mutating a returned copy never touches the cache
    assert (await here.get("alice")).state.balance == 15


async def test_replaying_runs_handlers_only(
    accounts: Repository[Account], store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await open_account(accounts, "alice", 10, 20)
    account = await accounts.get("alice")
    account.withdraw(30)
    await accounts.save(account)

    def no_commands(*args: object) -> None:
        raise AssertionError("a replay ran a command")

    for command in ("open", "deposit", "withdraw", "close", "_check_usable"):
        monkeypatch.setattr(Account, command, no_commands)
    for repo in (Repository(store, Account), Repository(store, Account, snapshot_every=2)):
        loaded = await repo.get("alice")
        assert (loaded.version, loaded.state.balance) == (4, 0)
        assert (await repo.get("alice", version=3)).state.balance == 30

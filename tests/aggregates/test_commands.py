"""Repository.execute: load, run, save; retries on conflicts; idempotent command ids; create commands."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from aggregates import AggregateExistsError, AggregateNotFoundError, CommandResult, Repository, RetryPolicy
from eventstore import ConcurrencyError, EventStore, InvalidArgumentError, StreamId

from .domain import Account, AccountError, InsufficientFunds

ALICE = StreamId("Account", "alice")


async def open_alice(accounts: Repository[Account], deposit: int = 0) -> None:
    await accounts.execute("alice", lambda a: a.open("Alice"), create=True)
    if deposit:
        await accounts.execute("alice", lambda a: a.deposit(deposit))


async def test_execute_creates_runs_and_saves(accounts: Repository[Account], store: EventStore) -> None:
    created = await accounts.execute("alice", lambda a: a.open("Alice"), create=True)
    assert (created.version, created.duplicate) == (1, False)
    result = await accounts.execute("alice", lambda a: a.deposit(7))
    assert result == CommandResult(value=7, version=2, position=result.position)
    assert result.position == (await store.state(ALICE)).position
    assert (await Repository(store, Account).get("alice")).state.balance == 7


async def test_execute_accepts_coroutine_commands(accounts: Repository[Account]) -> None:
    await open_alice(accounts)

    async def slow_deposit(account: Account) -> int:
        await asyncio.sleep(0)
        return account.deposit(3)

    assert (await accounts.execute("alice", slow_deposit)).value == 3


async def test_execute_without_create_needs_an_existing_aggregate(
    accounts: Repository[Account], store: EventStore
) -> None:
    with pytest.raises(AggregateNotFoundError):
        await accounts.execute("alice", lambda a: a.open("Alice"))
    assert await store.last_position() == 0


async def test_a_create_command_on_an_existing_aggregate_is_refused_and_stores_nothing(
    accounts: Repository[Account], store: EventStore
) -> None:
    await open_alice(accounts)
    before = await store.version(ALICE)
    with pytest.raises(AggregateExistsError, match=r"Account 'alice' exists already \(version 1\)") as refused:
        await accounts.execute("alice", lambda a: a.open("Mallory"), create=True)
    assert (refused.value.aggregate, refused.value.aggregate_id, refused.value.version) == ("Account", "alice", 1)
    assert "exist_ok=True" in str(refused.value)
    assert await store.version(ALICE) == before
    # Create-or-update is explicit: the command then runs on the aggregate as it is (here, its invariant refuses).
    with pytest.raises(AccountError, match="already open"):
        await accounts.execute("alice", lambda a: a.open("Mallory"), create=True, exist_ok=True)
    result = await accounts.execute("bob", lambda a: a.open("Bob"), create=True, exist_ok=True)  # new: created
    assert result.version == 1


async def test_a_resent_creation_is_a_duplicate_not_an_existing_aggregate(store: EventStore) -> None:
    first = await Repository(store, Account).execute("alice", lambda a: a.open("Alice"), create=True, command_id="c1")
    for repository in (Repository(store, Account), Repository(store, Account, cache_size=0)):  # cold and warm
        again = await repository.execute("alice", lambda a: a.open("Alice"), create=True, command_id="c1")
        assert (again.duplicate, again.version, again.position) == (True, first.version, first.position)
        with pytest.raises(AggregateExistsError):  # another command id: a second creation
            await repository.execute("alice", lambda a: a.open("Alice"), create=True, command_id="c2")
    assert await store.version(ALICE) == 1


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"exist_ok": True}, "exist_ok=True applies to a creating command: pass create=True with it."),
        ({"create": True, "exist_ok": 1}, "exist_ok"),
        ({"create": True, "exist_ok": "yes"}, "exist_ok"),
        ({"create": True, "exist_ok": None}, "exist_ok"),
    ],
)
async def test_exist_ok_is_checked_before_anything_runs(
    accounts: Repository[Account], store: EventStore, kwargs: dict[str, Any], says: str
) -> None:
    ran: list[int] = []
    with pytest.raises(InvalidArgumentError, match=re.escape(says)):
        await accounts.execute("alice", lambda a: ran.append(1), **kwargs)
    assert ran == [] and await store.version(ALICE) == 0


async def test_concurrent_creates_one_wins(store: EventStore) -> None:
    async def open_as(owner: str) -> CommandResult[None]:
        return await Repository(store, Account).execute("alice", lambda a: a.open(owner), create=True)

    outcomes = await asyncio.gather(*(open_as(f"owner{n}") for n in range(4)), return_exceptions=True)
    assert sum(isinstance(o, CommandResult) for o in outcomes) == 1
    assert all(isinstance(o, (CommandResult, AggregateExistsError)) for o in outcomes), outcomes
    assert await store.version(ALICE) == 1


async def test_a_refused_command_is_not_retried(accounts: Repository[Account], store: EventStore) -> None:
    await open_alice(accounts, deposit=5)
    runs = 0

    def overdraw(account: Account) -> int:
        nonlocal runs
        runs += 1
        return account.withdraw(6)

    before = await store.last_position()
    with pytest.raises(InsufficientFunds):
        await accounts.execute("alice", overdraw)
    assert runs == 1
    assert await store.last_position() == before


async def test_a_refusal_is_checked_against_the_store_not_a_stale_cache(store: EventStore) -> None:
    here, elsewhere = Repository(store, Account), Repository(store, Account)
    await open_alice(here)  # cached here with balance 0
    await elsewhere.execute("alice", lambda a: a.deposit(10))
    result = await here.execute("alice", lambda a: a.withdraw(5))  # the cached copy says 0, the store says 10
    assert (result.value, result.version) == (5, 3)
    query = await here.execute("alice", lambda a: a.state.balance)  # records nothing
    assert (query.value, query.version) == (5, 3)
    await elsewhere.execute("alice", lambda a: a.deposit(1))
    assert (await here.execute("alice", lambda a: a.state.balance)).value == 6


async def test_retries_are_bounded(store: EventStore) -> None:
    accounts = Repository(store, Account, retry=RetryPolicy(attempts=3, base_delay_s=0))
    meddler = Repository(store, Account)
    await open_alice(accounts)
    runs = 0

    async def deposit_while_someone_else_does(account: Account) -> None:
        nonlocal runs
        runs += 1
        await meddler.execute("alice", lambda a: a.deposit(100))
        account.deposit(1)

    with pytest.raises(ConcurrencyError):
        await accounts.execute("alice", deposit_while_someone_else_does)
    assert runs == 3
    assert (await Repository(store, Account).get("alice")).state.balance == 300


@pytest.mark.parametrize("shared_cache", [True, False], ids=["one-repository", "eight-repositories"])
async def test_no_lost_updates(store: EventStore, shared_cache: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    tasks, deposits = 8, 250
    shared = Repository(store, Account)
    repos = [shared if shared_cache else Repository(store, Account) for _ in range(tasks)]
    await open_alice(shared)
    conflicts = 0
    append = store.append

    async def counting_append(*args: Any, **kwargs: Any) -> Any:
        nonlocal conflicts
        try:
            return await append(*args, **kwargs)
        except ConcurrencyError:
            conflicts += 1
            raise

    monkeypatch.setattr(store, "append", counting_append)

    async def depositor(repo: Repository[Account]) -> None:
        for _ in range(deposits):
            await repo.execute("alice", lambda a: a.deposit(1))

    await asyncio.gather(*(depositor(r) for r in repos))
    alice = await Repository(store, Account).get("alice")
    assert (alice.state.balance, alice.version) == (tasks * deposits, tasks * deposits + 1)
    # One repository lets the commands take turns; eight (like eight processes) conflict and retry.
    assert (conflicts == 0) if shared_cache else (conflicts > 0)


# -- idempotency ----------------------------------------------------------------


async def test_a_repeated_command_id_stores_nothing_new(accounts: Repository[Account], store: EventStore) -> None:
    await open_alice(accounts)
    first = await accounts.execute("alice", lambda a: a.deposit(10), command_id="cmd-1")
    last = await store.last_position()
    again = await accounts.execute("alice", lambda a: a.deposit(10), command_id="cmd-1")
    assert again == CommandResult(None, first.version, first.position, duplicate=True)
    assert await store.last_position() == last
    other = await accounts.execute("alice", lambda a: a.deposit(10), command_id="cmd-2")
    assert (other.version, other.duplicate) == (3, False)


async def test_a_repeated_command_after_newer_events_returns_the_first_version(store: EventStore) -> None:
    here, elsewhere = Repository(store, Account), Repository(store, Account)
    await open_alice(here)
    first = await here.execute("alice", lambda a: a.deposit(10), command_id="cmd-1")  # version 2
    await elsewhere.execute("alice", lambda a: a.deposit(1))  # version 3
    for repo in (here, elsewhere, Repository(store, Account)):  # stale cache, fresh cache, no cache
        last = await store.last_position()
        again = await repo.execute("alice", lambda a: a.deposit(10), command_id="cmd-1")
        assert (again.version, again.position, again.duplicate) == (2, first.position, True)
        assert await store.last_position() == last
    assert (await Repository(store, Account).get("alice")).state.balance == 11


async def test_a_repeated_command_whose_rerun_is_refused_returns_the_first_result(
    accounts: Repository[Account], store: EventStore
) -> None:
    await open_alice(accounts, deposit=10)
    first = await accounts.execute("alice", lambda a: a.withdraw(10), command_id="withdraw-1")
    # Running it again would overdraw; being the same command, it is answered from the store.
    for repo in (accounts, Repository(store, Account)):
        again = await repo.execute("alice", lambda a: a.withdraw(10), command_id="withdraw-1")
        assert (again.version, again.position, again.duplicate) == (first.version, first.position, True)
    with pytest.raises(InsufficientFunds):
        await accounts.execute("alice", lambda a: a.withdraw(10), command_id="withdraw-2")


async def test_a_repeated_create_command(accounts: Repository[Account], store: EventStore) -> None:
    first = await accounts.execute("alice", lambda a: a.open("Alice"), create=True, command_id="open-1")
    for repo in (accounts, Repository(store, Account)):
        again = await repo.execute("alice", lambda a: a.open("Alice"), create=True, command_id="open-1")
        assert (again.version, again.position, again.duplicate) == (1, first.position, True)
    assert await store.version(ALICE) == 1


async def test_command_ids_under_contention(store: EventStore) -> None:
    repos = [Repository(store, Account) for _ in range(4)]
    await open_alice(repos[0])

    async def client(n: int, repo: Repository[Account]) -> None:
        for i in range(15):
            command_id = f"client{n}-{i}"
            results = await asyncio.gather(  # the same command sent twice at once, as a resend would
                repo.execute("alice", lambda a: a.deposit(1), command_id=command_id),
                repos[(n + 1) % 4].execute("alice", lambda a: a.deposit(1), command_id=command_id),
            )
            assert sorted(r.duplicate for r in results) == [False, True]
            assert results[0].version == results[1].version

    await asyncio.gather(*(client(n, r) for n, r in enumerate(repos)))
    alice = await Repository(store, Account).get("alice")
    assert (alice.state.balance, alice.version) == (60, 61)


async def test_correlation_and_causation_flow_into_the_events(
    accounts: Repository[Account], store: EventStore
) -> None:
    await open_alice(accounts)
    await accounts.execute("alice", lambda a: a.deposit(1), command_id="cmd-9", correlation_id="order-77")
    await accounts.execute("alice", lambda a: a.deposit(1), correlation_id="order-77", causation_id="event-5")
    first, second = await store.read(ALICE, from_version=2)
    assert (first.correlation_id, first.causation_id) == ("order-77", "cmd-9")
    assert (second.correlation_id, second.causation_id) == ("order-77", "event-5")

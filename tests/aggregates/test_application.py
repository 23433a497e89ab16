"""The Application object (the dog school in 15 lines of domain code), ids, and given/when/then scenarios."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from aggregates import (
    Aggregate,
    Application,
    CommandClient,
    DomainEvent,
    InvalidAggregateIdError,
    Repository,
    applies,
    new_id,
    scenario,
)
from eventstore import EventLog, EventStore, EventStoreSettings, InMemoryEventStore, InvalidArgumentError
from tests.conftest import unique_settings

from .domain import Account, AccountOpened, Deposited, InsufficientFunds, Withdrawn

ROOT = Path(__file__).resolve().parents[2]


class Registered(DomainEvent):
    name: str


class TrickAdded(DomainEvent):
    trick: str


class DogState(BaseModel):
    name: str = ""
    tricks: list[str] = []


@pytest.fixture(params=["jetstream", "memory"])
def any_store(request: pytest.FixtureRequest) -> EventLog:
    """The test's JetStream store, or an in-memory one: given/when/then works on both."""
    if request.param == "jetstream":
        store: EventStore = request.getfixturevalue("store")
        return store
    return InMemoryEventStore()


class Dog(Aggregate[DogState]):
    def register(self, name: str) -> None:
        self.record(Registered(name=name))

    def add_trick(self, trick: str) -> None:
        self.record(TrickAdded(trick=trick))

    @applies(Registered)
    def _registered(self, event: Registered) -> None:
        self.state.name = event.name

    @applies(TrickAdded)
    def _trick_added(self, event: TrickAdded) -> None:
        self.state.tricks.append(event.trick)


class DogSchool(Application):
    async def register_dog(self, name: str) -> str:
        dog_id = new_id()
        await self.repository(Dog).execute(dog_id, lambda dog: dog.register(name), create=True)
        return dog_id

    async def add_trick(self, dog_id: str, trick: str) -> None:
        await self.repository(Dog).execute(dog_id, lambda dog: dog.add_trick(trick))


async def test_the_dog_school(nats_url: str) -> None:
    settings = unique_settings(nats_url)
    async with DogSchool.connect(settings) as school:
        fido = await school.register_dog("Fido")
        await school.add_trick(fido, "roll over")
        await school.add_trick(fido, "play dead")
        dog = await school.repository(Dog).get(uuid.UUID(fido))  # a UUID names the same aggregate as its text
        assert (dog.state.name, dog.state.tricks, dog.version) == ("Fido", ["roll over", "play dead"], 3)
        store = school.store
    assert store.nc.is_closed  # connect() owns the store: leaving closes it
    school = await DogSchool.connect(settings)  # awaited instead: the caller closes it
    try:
        assert (await school.repository(Dog).get(fido)).state.tricks == ["roll over", "play dead"]
    finally:
        await school.close()


async def test_an_application_around_a_store_it_does_not_own(store: EventStore) -> None:
    app = Application(store, cache_size=0)
    accounts = app.repository(Account)
    assert app.repository(Account) is accounts and accounts.cache_size == 0
    await accounts.execute("a1", lambda a: a.open("Ann"), create=True)
    await app.close()
    assert not store.nc.is_closed  # not its store to close
    with pytest.raises(InvalidArgumentError, match="exists already"):
        app.repository(Account, cache_size=5)
    with pytest.raises(InvalidArgumentError, match="Aggregate class"):
        app.repository(int)  # type: ignore[type-var]
    with pytest.raises(InvalidArgumentError, match="connected EventStore"):
        Application("nats://localhost")  # type: ignore[arg-type]


async def test_its_command_service_serves_its_repositories(store: EventStore) -> None:
    class Register(BaseModel):
        name: str

    app = DogSchool(store)
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    service = app.command_service(subject_prefix=prefix)
    service.add(app.repository(Dog), Register, lambda dog, c: dog.register(c.name), create=True)
    async with service:
        dog_id = new_id()
        reply = await CommandClient(store, subject_prefix=prefix).send(Dog, dog_id, Register(name="Rex"))
    assert reply.version == 1 and (await app.repository(Dog).get(dog_id)).state.name == "Rex"


def test_new_ids_are_unique_uuids() -> None:
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(uuid.UUID(i).version == 4 for i in ids)


async def test_uuid_and_str_ids_name_the_same_aggregate(store: EventStore) -> None:
    accounts = Repository(store, Account)
    key = uuid.uuid4()
    await accounts.execute(key, lambda a: a.open("Uma"), create=True)
    await accounts.execute(str(key), lambda a: a.deposit(3))
    assert (await accounts.get(key)).state.balance == 3
    assert (await Repository(store, Account, cache_size=0).get(str(key))).version == 2
    for bad in (5, b"bytes", None, ""):
        with pytest.raises(InvalidAggregateIdError):
            await accounts.get(bad)  # type: ignore[arg-type]


async def test_given_when_then_checks_the_events_recorded(any_store: EventLog) -> None:
    recorded = await scenario(any_store, Account).given(AccountOpened(owner="Ann"), Deposited(amount=10)).when(
        lambda a: a.withdraw(4)
    ).then(Withdrawn(amount=4))
    assert recorded == [Withdrawn(amount=4)]
    await scenario(any_store, Account).when(lambda a: a.open("Bo")).then(AccountOpened(owner="Bo"))  # no history: created


async def test_given_when_then_checks_the_error_and_that_nothing_was_stored(any_store: EventLog) -> None:
    await scenario(any_store, Account).given(AccountOpened(owner="Ann")).when(lambda a: a.withdraw(1)).then(InsufficientFunds)
    sc = scenario(any_store, Account).given(AccountOpened(owner="Ann"))
    await sc.when(lambda a: a.withdraw(1)).then(InsufficientFunds)
    assert len(await any_store.read(Account._stream_id(sc.aggregate_id))) == 1  # only the given event


@pytest.mark.parametrize(
    ("expected", "message"),
    [
        ((Withdrawn(amount=5),), r"recorded \[Withdrawn\(amount=4\)\]; expected \[Withdrawn\(amount=5\)\]"),
        ((), r"recorded \[Withdrawn\(amount=4\)\]; expected \[\]"),
        ((InsufficientFunds,), r"recorded \[Withdrawn\(amount=4\)\] instead of raising InsufficientFunds"),
        ((KeyError,), r"recorded .* instead of raising KeyError"),
    ],
)
async def test_a_failed_then_says_what_differs(any_store: EventLog, expected: tuple[Any, ...], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        await scenario(any_store, Account).given(AccountOpened(owner="Ann"), Deposited(amount=10)).when(
            lambda a: a.withdraw(4)
        ).then(*expected)


async def test_a_then_expecting_events_reports_an_unexpected_error(any_store: EventLog) -> None:
    with pytest.raises(AssertionError, match="raised InsufficientFunds: .*expected events"):
        await scenario(any_store, Account).given(AccountOpened(owner="Ann")).when(lambda a: a.withdraw(1)).then(
            Withdrawn(amount=1)
        )
    with pytest.raises(AssertionError, match="raised InsufficientFunds: .*expected KeyError"):
        await scenario(any_store, Account).given(AccountOpened(owner="Ann")).when(lambda a: a.withdraw(1)).then(KeyError)


def test_pytest_reports_a_failed_then_at_the_test_not_inside_the_scenario(tmp_path: Path) -> None:
    # The reader of a failed domain test wants the test's line and what differs, not the scenario's own code.
    (tmp_path / "test_failing.py").write_text(textwrap.dedent("""
        import pytest
        from aggregates import scenario
        from eventstore import InMemoryEventStore
        from tests.aggregates.domain import Account, AccountOpened, Deposited, Withdrawn

        @pytest.mark.asyncio
        async def test_withdraw() -> None:
            await scenario(InMemoryEventStore(), Account).given(AccountOpened(owner="Ann"), Deposited(amount=10)).when(
                lambda a: a.withdraw(4)).then(Withdrawn(amount=5))
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o",
                           "asyncio_default_fixture_loop_scope=function", "test_failing.py"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "AssertionError: The command recorded [Withdrawn(amount=4)]; expected [Withdrawn(amount=5)]." in done.stdout
    assert "test_failing.py:9: AssertionError" in done.stdout, done.stdout
    assert "aggregates/testing.py" not in done.stdout, done.stdout


async def test_scenario_arguments_are_checked(any_store: EventLog) -> None:
    with pytest.raises(InvalidArgumentError, match="event instances"):
        scenario(any_store, Account).given({"owner": "x"})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="function of the aggregate"):
        scenario(any_store, Account).when("withdraw")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="needs when"):
        await scenario(any_store, Account).then(Withdrawn(amount=1))
    with pytest.raises(InvalidArgumentError, match="not both"):
        await scenario(any_store, Account).when(lambda a: a.open("x")).then(AccountOpened(owner="x"), KeyError)


async def test_an_application_connects_with_settings_from_the_environment(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = unique_settings(nats_url)
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("JETSOURCING_STREAM", settings.stream)
    monkeypatch.setenv("JETSOURCING_SUBJECT_PREFIX", settings.subject_prefix)
    async with DogSchool.connect() as school:
        assert school.store.settings == EventStoreSettings()
        assert await school.register_dog("Env")


async def test_the_dog_school_in_memory() -> None:
    async with InMemoryEventStore() as store:
        school = DogSchool(store)
        fido = await school.register_dog("Fido")
        await school.add_trick(fido, "roll over")
        dog = await school.repository(Dog).get(fido)
        assert (dog.state.name, dog.state.tricks, dog.version) == ("Fido", ["roll over"], 2)
        accounts = school.repository(Account)
        first = await accounts.execute("acc", lambda a: a.open("Ann"), create=True, command_id="open-1")
        again = await accounts.execute("acc", lambda a: a.open("Ann"), create=True, command_id="open-1")
        assert again.duplicate and again.position == first.position and await store.version(
            Account._stream_id("acc")) == 1


async def test_what_needs_a_server_says_so_in_memory() -> None:
    store = InMemoryEventStore()
    with pytest.raises(InvalidArgumentError, match="snapshot_every needs an EventStore"):
        Application(store).repository(Account, snapshot_every=10)
    with pytest.raises(InvalidArgumentError, match="command_service\\(\\) needs an EventStore"):
        Application(store).command_service()

"""Bad input gives typed errors that name the aggregate, the position and the type; nothing is written."""

from __future__ import annotations

import inspect
import pytest

import aggregates
from aggregates import (
    AggregateError,
    InvalidAggregateIdError,
    InvalidStoredEventError,
    MissingHandlerError,
    Repository,
    UnregisteredEventError,
    applies,
)
from eventstore import EventDecodeError, EventStore, StreamId, UnknownEventTypeError

from .conftest import RawPublish
from .domain import Account, Cart, Withdrawn

ALICE = StreamId("Account", "alice")


def test_every_error_derives_from_aggregate_error() -> None:
    errors = [v for v in vars(aggregates).values() if inspect.isclass(v) and issubclass(v, Exception)]
    assert len(errors) == 15
    assert all(issubclass(e, AggregateError) for e in errors)
    assert issubclass(UnregisteredEventError, UnknownEventTypeError)
    assert issubclass(InvalidStoredEventError, EventDecodeError)


async def opened_alice(store: EventStore) -> Repository[Account]:
    accounts = Repository(store, Account, cache_size=0)
    await accounts.execute("alice", lambda a: a.open("Alice"), create=True)
    return accounts


async def test_an_unregistered_stored_type(store: EventStore, raw_publish: RawPublish) -> None:
    accounts = await opened_alice(store)
    position = await raw_publish(ALICE, "Mystery", 1, b"{}", 2)
    with pytest.raises(UnregisteredEventError) as info:
        await accounts.get("alice")
    error = info.value
    assert (error.aggregate, error.aggregate_id, error.event_type, error.position) == ("Account", "alice", "Mystery", position)
    assert f"Cannot load Account 'alice': the event at position {position} has type 'Mystery'" in str(error)
    assert "Unknown event type 'Mystery'" in str(error)


async def test_a_stored_schema_newer_than_this_program(store: EventStore, raw_publish: RawPublish) -> None:
    accounts = await opened_alice(store)
    position = await raw_publish(ALICE, "Deposited", 9, b'{"amount": 1}', 2)
    with pytest.raises(UnregisteredEventError, match=f"position {position} has type 'Deposited'.*newer than"):
        await accounts.get("alice")


async def test_a_stored_payload_failing_validation(store: EventStore, raw_publish: RawPublish) -> None:
    accounts = await opened_alice(store)
    position = await raw_publish(ALICE, "Deposited", 1, b'{"amount": "lots"}', 2)
    with pytest.raises(InvalidStoredEventError) as info:
        await accounts.get("alice")
    error = info.value
    assert (error.aggregate, error.event_type, error.position) == ("Account", "Deposited", position)
    assert f"the 'Deposited' event at position {position} cannot be read" in str(error)
    assert "amount" in str(error)


async def test_a_stored_type_without_handler(store: EventStore, raw_publish: RawPublish) -> None:
    accounts = await opened_alice(store)
    Repository(store, Cart)  # registers CartCreated: readable, but not an Account event
    position = await raw_publish(ALICE, "CartCreated", 1, b'{"customer": "c"}', 2)
    with pytest.raises(MissingHandlerError, match=f"'CartCreated' stored at position {position}") as info:
        await accounts.get("alice")
    assert (info.value.aggregate, info.value.position) == ("Account", position)


async def test_commands_on_unreadable_aggregates_write_nothing(store: EventStore, raw_publish: RawPublish) -> None:
    accounts = await opened_alice(store)
    await raw_publish(ALICE, "Mystery", 1, b"{}", 2)
    last = await store.last_position()
    with pytest.raises(UnregisteredEventError):
        await Repository(store, Account).execute("alice", lambda a: a.deposit(1))
    assert await store.last_position() == last


async def test_a_failing_handler_says_where_it_failed(store: EventStore, raw_publish: RawPublish) -> None:
    accounts = await opened_alice(store)
    position = await raw_publish(ALICE, "Withdrawn", 1, b'{"amount": 5}', 2)

    class Fragile(Account, category="Account"):
        @applies(Withdrawn)
        def _withdrawn(self, event: Withdrawn) -> None:
            raise ZeroDivisionError("a bug in a handler")

    with pytest.raises(ZeroDivisionError) as info:
        await Repository(store, Fragile).get("alice")
    assert f"at the 'Withdrawn' event at position {position}" in "".join(info.value.__notes__)
    assert (await accounts.get("alice")).state.balance == -5  # a replay checks no invariant


@pytest.mark.parametrize("bad_id", ["", "x" * 300, "bell\x07"])
async def test_illegal_ids_are_refused_before_anything_is_written(store: EventStore, bad_id: str) -> None:
    accounts = Repository(store, Account)
    with pytest.raises(InvalidAggregateIdError):
        await accounts.execute(bad_id, lambda a: a.open("X"), create=True)
    with pytest.raises(InvalidAggregateIdError):
        await accounts.get(bad_id)
    with pytest.raises(InvalidAggregateIdError):
        await accounts.get(bad_id, version=1)
    assert await store.last_position() == 0

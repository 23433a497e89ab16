"""Repository arguments are checked before anything is loaded or stored."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aggregates import AggregateNotFoundError, InvalidAggregateIdError, Repository
from eventstore import EventStore, InvalidArgumentError

from .domain import Account, AccountError


@pytest.mark.parametrize("aggregate_id", [["a"], {"a": 1}, 42, None, b"alice", ""], ids=repr)
async def test_an_aggregate_id_that_cannot_name_a_stream_is_refused(
    accounts: Repository[Account], store: EventStore, aggregate_id: Any
) -> None:
    with pytest.raises(InvalidAggregateIdError):
        await accounts.execute(aggregate_id, lambda a: a.open("X"), create=True)
    with pytest.raises(InvalidAggregateIdError):
        await accounts.get(aggregate_id)
    assert await store.last_position() == 0


@pytest.mark.parametrize("command", [None, "open", 5, object()], ids=repr)
async def test_a_command_must_be_callable_with_the_aggregate(
    accounts: Repository[Account], store: EventStore, command: Any
) -> None:
    with pytest.raises(InvalidArgumentError, match="command"):
        await accounts.execute("alice", command, create=True)
    assert await store.last_position() == 0


@pytest.mark.parametrize("create", ["yes", 1, None, "False"], ids=repr)
async def test_create_must_be_a_bool(accounts: Repository[Account], store: EventStore, create: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="create"):
        await accounts.execute("alice", lambda a: a.open("Alice"), create=create)
    assert await store.last_position() == 0


@pytest.mark.parametrize("version", ["1", 1.5, 1.0, True, 0, -1], ids=repr)
async def test_get_version_must_be_an_int_from_one(accounts: Repository[Account], version: Any) -> None:
    await accounts.execute("alice", lambda a: a.open("Alice"), create=True)
    with pytest.raises(InvalidArgumentError, match="version"):
        await accounts.get("alice", version=version)


def _open(account: Account) -> None:
    account.open("Owner")


ids = st.lists(
    st.one_of(st.characters(codec=None), st.sampled_from([".", "*", ">", "%", " ", "\n", "\x00", "\ud800", "\U0001f600"])),
    max_size=10,
).map("".join)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    aggregate_id=st.one_of(ids, st.none(), st.integers(), st.lists(st.text(max_size=2), max_size=1)),
    command=st.sampled_from([_open, None, "open", 5]),
    create=st.one_of(st.booleans(), st.none(), st.integers(0, 1), st.text(max_size=2)),
)
@example(aggregate_id="alice.é %", command=_open, create=True)
async def test_execute_stores_exactly_what_the_command_recorded_or_refuses_and_stores_nothing(
    accounts: Repository[Account], store: EventStore, aggregate_id: Any, command: Any, create: Any
) -> None:
    before = await store.last_position()
    try:
        result = await accounts.execute(aggregate_id, command, create=create)
    except (InvalidAggregateIdError, InvalidArgumentError, AggregateNotFoundError, AccountError):
        assert await store.last_position() == before
        return
    assert command is _open and create is True and isinstance(aggregate_id, str)
    assert (await Repository(store, Account).get(aggregate_id)).state.owner == "Owner"  # a fresh replay
    assert result.position == await store.last_position()

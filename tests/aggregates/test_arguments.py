"""Repository arguments are checked before anything is loaded or stored."""

from __future__ import annotations

from typing import Any

import pytest

from aggregates import InvalidAggregateIdError, Repository
from eventstore import EventStore, InvalidArgumentError

from .domain import Account


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

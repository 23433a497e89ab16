"""Fixtures for the aggregates tests: repositories over the shared per-test store, a raw publisher, and a command
client on a subject prefix of the test's own."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import pytest

from aggregates import CommandClient, Repository
from eventstore import EventStore, Header, StreamId

from .domain import Account, Cart, Order

RawPublish = Callable[..., Awaitable[int]]


@pytest.fixture
def accounts(store: EventStore) -> Repository[Account]:
    return Repository(store, Account)


@pytest.fixture
def carts(store: EventStore) -> Repository[Cart]:
    return Repository(store, Cart)


@pytest.fixture
def orders(store: EventStore) -> Repository[Order]:
    return Repository(store, Order)


@pytest.fixture
def prefix() -> str:
    """A command subject prefix of this test's own."""
    return f"cmd{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(store: EventStore, prefix: str) -> CommandClient:
    """A command client on ``prefix``."""
    return CommandClient(store, subject_prefix=prefix, timeout_s=5)


@pytest.fixture
def raw_publish(store: EventStore) -> RawPublish:
    """Publish one single-event commit with plain nats-py, as another writer (or an old version) would."""

    async def publish(stream_id: StreamId, type_name: str, schema_version: int, payload: bytes, version: int) -> int:
        headers = {
            Header.MSG_ID: uuid.uuid4().hex,
            Header.TYPE: type_name,
            Header.SCHEMA_VERSION: str(schema_version),
            Header.EVENT_ID: uuid.uuid4().hex,
            Header.VERSION: str(version),
            Header.RECORDED_AT: "2020-01-01T00:00:00.000000+00:00",
        }
        js = store.nc.jetstream()
        ack = await js.publish(stream_id.subject(store.settings.subject_prefix), payload, headers=headers)
        return int(ack.seq)

    return publish

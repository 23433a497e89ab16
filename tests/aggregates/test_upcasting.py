"""Upcasting: events stored by older releases (here: published with plain nats-py) load as the newest model."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from aggregates import Aggregate, DomainEvent, InvalidStoredEventError, Repository, applies, upcaster
from eventstore import EventStore, StreamId

from .conftest import RawPublish

# Release 1 stored {"amount": <euros>}; release 2 added the currency; release 3 (this one) counts cents.


class Deposited(DomainEvent, version=3):
    amount_cents: int
    currency: str


@upcaster(Deposited, from_version=1)
def _add_currency(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "currency": "EUR"}


@upcaster(Deposited, from_version=2)
def _to_cents(data: dict[str, Any]) -> dict[str, Any]:
    return {"amount_cents": data["amount"] * 100, "currency": data["currency"]}


class WalletState(BaseModel):
    balances: dict[str, int] = {}


class Wallet(Aggregate[WalletState]):
    def deposit(self, cents: int, currency: str) -> None:
        self.record(Deposited(amount_cents=cents, currency=currency))

    @applies(Deposited)
    def _deposited(self, event: Deposited) -> None:
        assert isinstance(event, Deposited)  # domain code only ever sees the newest model
        self.state.balances[event.currency] = self.state.balances.get(event.currency, 0) + event.amount_cents


WALLET = StreamId("Wallet", "w1")


async def test_old_events_are_upcast_on_read(store: EventStore, raw_publish: RawPublish) -> None:
    wallets = Repository(store, Wallet)
    await raw_publish(WALLET, "Deposited", 1, json.dumps({"amount": 5}).encode(), 1)
    await raw_publish(WALLET, "Deposited", 2, json.dumps({"amount": 2, "currency": "USD"}).encode(), 2)
    await raw_publish(WALLET, "Deposited", 1, json.dumps({"amount": 1}).encode(), 3)
    wallet = await wallets.get("w1")
    assert (wallet.version, wallet.state.balances) == (3, {"EUR": 600, "USD": 200})
    await wallets.execute("w1", lambda w: w.deposit(50, "EUR"))  # stored as version 3
    events = await store.read(WALLET)
    assert [e.schema_version for e in events] == [1, 2, 1, 3]
    assert events[0].data == Deposited(amount_cents=500, currency="EUR")
    assert (await Repository(store, Wallet, cache_size=0).get("w1")).state.balances == {"EUR": 650, "USD": 200}


async def test_stored_fields_a_model_no_longer_declares_are_left_out_on_read(
    store: EventStore, raw_publish: RawPublish
) -> None:
    # Written by another release: a field since removed at the top, one inside a nested model, both current and
    # upcast versions. Constructing such an event in code is refused; reading one is not.
    await raw_publish(WALLET, "Deposited", 3, b'{"amount_cents": 5, "currency": "EUR", "memo": "x"}', 1)
    await raw_publish(WALLET, "Deposited", 1, b'{"amount": 1, "legacy": true}', 2)
    wallet = await Repository(store, Wallet).get("w1")
    assert (wallet.version, wallet.state.balances) == (2, {"EUR": 105})
    assert (await store.read(WALLET))[0].data == Deposited(amount_cents=5, currency="EUR")
    store.registry.register(Tagged)
    await raw_publish(StreamId("Tagged", "t"), "Tagged", 1, b'{"tag": {"name": "a", "color": "red"}, "n": 1}', 1)
    assert (await store.read(StreamId("Tagged", "t")))[0].data == Tagged(tag=Tag(name="a"), n=1)
    # A wrong type is still an error, whatever else is extra.
    await raw_publish(WALLET, "Deposited", 3, b'{"amount_cents": "lots", "currency": "EUR", "memo": "x"}', 3)
    with pytest.raises(InvalidStoredEventError, match="amount_cents"):
        await Repository(store, Wallet, cache_size=0).get("w1")


class Tag(BaseModel):
    model_config = {"extra": "forbid"}
    name: str


class Tagged(DomainEvent):
    tag: Tag
    n: int


async def test_upcasting_works_through_snapshots_and_time_travel(store: EventStore, raw_publish: RawPublish) -> None:
    wallets = Repository(store, Wallet, snapshot_every=2, cache_size=0)
    for version in range(1, 5):
        await raw_publish(WALLET, "Deposited", 1, json.dumps({"amount": version}).encode(), version)
    assert (await wallets.get("w1")).state.balances == {"EUR": 1000}  # writes a snapshot
    assert (await wallets.get("w1")).state.balances == {"EUR": 1000}  # from it
    assert (await wallets.get("w1", version=2)).state.balances == {"EUR": 300}


class Renamed(DomainEvent, type_name="Renamed", version=2):
    name: str


class Named(BaseModel):
    name: str = ""


class Badge(Aggregate[Named]):
    @applies(Renamed)
    def _renamed(self, event: Renamed) -> None:
        self.state.name = event.name


async def test_a_missing_upcaster_names_the_event(store: EventStore, raw_publish: RawPublish) -> None:
    badges = Repository(store, Badge)
    position = await raw_publish(StreamId("Badge", "b"), "Renamed", 1, b'{"title": "x"}', 1)
    with pytest.raises(InvalidStoredEventError, match=f"'Renamed' event at position {position}") as info:
        await badges.get("b")
    assert "no upcaster from version 1 to 2" in str(info.value)
    assert (info.value.aggregate, info.value.aggregate_id, info.value.position) == ("Badge", "b", position)


async def test_an_upcaster_that_fails_names_the_event(store: EventStore, raw_publish: RawPublish) -> None:
    wallets = Repository(store, Wallet)
    position = await raw_publish(WALLET, "Deposited", 2, b'{"amount": 1}', 1)  # version 2 without currency
    with pytest.raises(InvalidStoredEventError, match=f"position {position}"):
        await wallets.get("w1")

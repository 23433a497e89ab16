"""An event is stored only if it can be read back equal; what a foreign writer left on an entity's
subject is reported as a typed error naming its position, never as a raw KeyError."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel

from eventstore import (
    ANY,
    EventDecodeError,
    EventStore,
    InvalidEventError,
    InvalidStreamIdError,
    StreamId,
)

from .events import Deposited

ACCOUNT = StreamId("Account", "1")


class Measured(BaseModel):
    value: float
    maybe: float | None = None
    series: list[float] = []


class Inner(BaseModel):
    ratio: float


class Outer(BaseModel):
    inner: Inner


class Blob(BaseModel):
    data: bytes


class Text(BaseModel):
    text: str


@pytest.fixture
def store(store: EventStore) -> EventStore:
    for model in (Measured, Outer, Blob, Text):
        store.registry.register(model)
    return store


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (Measured(value=math.nan), "value"),
        (Measured(value=math.inf), "value"),
        (Measured(value=-math.inf), "value"),
        (Measured(value=1.0, maybe=math.nan), "maybe"),
        (Measured(value=1.0, series=[1.0, math.inf]), "series"),
        (Outer(inner=Inner(ratio=math.nan)), "inner"),
    ],
    ids=repr,
)
async def test_a_float_that_json_cannot_hold_is_refused_at_append(store: EventStore, event: BaseModel, field: str) -> None:
    await store.append(ACCOUNT, [Deposited(amount=1)])
    with pytest.raises(InvalidEventError, match=rf"{type(event).__name__} to Account/1: field {field}\b") as info:
        await store.append(ACCOUNT, [Deposited(amount=2), event])
    assert "Nothing was stored" in str(info.value)
    assert await store.last_position() == 1
    assert [e.data for e in await store.read(ACCOUNT)] == [Deposited(amount=1)]


@pytest.mark.parametrize(
    "event",
    [Measured(value=1e308, maybe=-0.0, series=[5e-324, -1e-300, 0.1]), Text(text="a\u2028b\x00\U0001F600"),
     Blob(data="é€😀".encode())],
    ids=repr,
)
async def test_values_json_can_hold_are_stored_and_read_back_equal(store: EventStore, event: BaseModel) -> None:
    await store.append(ACCOUNT, [event])
    (recorded,) = await store.read(ACCOUNT)
    assert recorded.data == event


@pytest.mark.parametrize("event", [Blob(data=b"\xff\xfe"), Text(text="lone \udc80 surrogate")], ids=repr)
async def test_text_that_has_no_utf8_form_is_refused_as_an_invalid_event(store: EventStore, event: BaseModel) -> None:
    with pytest.raises(InvalidEventError, match=f"{type(event).__name__} to Account/1"):
        await store.append(ACCOUNT, [event])
    assert await store.last_position() == 0


@pytest.mark.parametrize("entity_id", ["\ud800", "a\udfffb", "ok\udc80"], ids=repr)
def test_an_entity_id_with_a_lone_surrogate_is_an_invalid_stream_id(entity_id: str) -> None:
    with pytest.raises(InvalidStreamIdError, match="surrogate"):
        StreamId("Account", entity_id)


@pytest.mark.parametrize("headers", [None, {"X-Other": "1"}, {"Es-Type": "Deposited"}], ids=repr)
async def test_a_foreign_message_on_an_entity_subject_is_a_decode_error_naming_its_position(
    store: EventStore, headers: dict[str, str] | None
) -> None:
    subject = ACCOUNT.subject(store.settings.subject_prefix)
    ack = await store.nc.jetstream().publish(subject, b"plain", headers=headers)
    position = rf"position {ack.seq}\b"
    with pytest.raises(EventDecodeError, match=position):
        await store.state(ACCOUNT)
    with pytest.raises(EventDecodeError, match=position):
        await store.version(ACCOUNT)
    with pytest.raises(EventDecodeError, match=position):
        await store.append(ACCOUNT, [Deposited(amount=1)], expected_version=ANY)
    with pytest.raises(EventDecodeError, match=position):
        await store.catalogue("Account")
    with pytest.raises(EventDecodeError, match=position):
        await store.read(ACCOUNT)
    assert await store.last_position() == ack.seq  # the refused append stored nothing

"""Every public argument is checked before anything is sent: a wrong one is refused with a typed error
naming it, and nothing is stored (the stream's last position does not move)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from pydantic import ValidationError

from eventstore import (
    ANY,
    NO_STREAM,
    EntityAppend,
    EventStore,
    EventStoreError,
    EventStoreSettings,
    InvalidArgumentError,
    InvalidEventError,
    InvalidStreamIdError,
    StreamId,
)

from .events import Deposited

ACCOUNT = StreamId("Account", "1")
HOSTILE_VERSIONS = ["1", 2.0, 1.5, math.nan, None, [2], object(), "any", True, False, -1, b"1"]


async def refused(store: EventStore, call: Callable[[], Awaitable[Any]], error: type[Exception], name: str) -> None:
    """``call`` raises ``error`` naming ``name``, and the stream's last position did not move."""
    before = await store.last_position()
    with pytest.raises(error, match=name):
        await call()
    assert await store.last_position() == before


@pytest.mark.parametrize("expected", HOSTILE_VERSIONS, ids=repr)
async def test_an_expected_version_of_the_wrong_type_is_refused_not_taken_as_any(store: EventStore, expected: Any) -> None:
    await store.append(ACCOUNT, [Deposited(amount=1)], expected_version=NO_STREAM)
    await refused(store, lambda: store.append(ACCOUNT, [Deposited(amount=2)], expected_version=expected),
                  InvalidArgumentError, "expected_version")
    with pytest.raises(InvalidArgumentError, match="expected_version"):
        EntityAppend(ACCOUNT, [Deposited(amount=2)], expected)
    assert issubclass(InvalidArgumentError, (TypeError)) and issubclass(InvalidArgumentError, ValueError)
    assert issubclass(InvalidArgumentError, EventStoreError)


@pytest.mark.parametrize(
    ("expected", "position"),
    [(1, "5"), (1, -1), (1, 1.0), (1, True), (ANY, 1), (NO_STREAM, 1), (0, 3), (2, 0)],
    ids=repr,
)
async def test_an_expected_position_that_cannot_hold_is_refused(store: EventStore, expected: Any, position: Any) -> None:
    await store.append(ACCOUNT, [Deposited(amount=1)], expected_version=NO_STREAM)
    await refused(
        store,
        lambda: store.append(ACCOUNT, [Deposited(amount=2)], expected_version=expected, expected_position=position),
        InvalidArgumentError,
        "expected_position",
    )


@pytest.mark.parametrize(
    "events",
    ["Deposited", b"{}", {"amount": 1}, Deposited(amount=1), (e for e in [Deposited(amount=1)]), 7, None],
    ids=["str", "bytes", "dict", "a bare model", "generator", "int", "None"],
)
async def test_events_must_be_a_list_of_models(store: EventStore, events: Any) -> None:
    await refused(store, lambda: store.append(ACCOUNT, events), InvalidArgumentError, "events")


async def test_events_must_be_model_instances_and_not_empty(store: EventStore) -> None:
    await refused(store, lambda: store.append(ACCOUNT, []), InvalidEventError, "empty")
    await refused(store, lambda: store.append(ACCOUNT, [Deposited]), InvalidEventError, "instances")
    await refused(store, lambda: store.append(ACCOUNT, [Deposited(amount=1), "x"]), InvalidEventError, "instances")


@pytest.mark.parametrize("stream_id", ["Account/1", ("Account", "1"), None], ids=repr)
async def test_a_stream_id_must_be_a_stream_id(store: EventStore, stream_id: Any) -> None:
    await refused(store, lambda: store.append(stream_id, [Deposited(amount=1)]), InvalidArgumentError, "stream_id")
    for call in (store.state, store.version, lambda s: store.read(s), lambda s: store.find_append(s, "k")):
        with pytest.raises(InvalidArgumentError, match="stream_id"):
            await call(stream_id)
    with pytest.raises(InvalidArgumentError, match="stream_id"):
        store.remember(stream_id, 1, 1)


@pytest.mark.parametrize("requests", ["Account", [ACCOUNT], [(ACCOUNT, [Deposited(amount=1)])], None], ids=repr)
async def test_append_many_takes_a_list_of_entity_appends(store: EventStore, requests: Any) -> None:
    await refused(store, lambda: store.append_many(requests), InvalidArgumentError, "requests")


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("from_version", 0), ("from_version", "1"), ("from_version", True), ("from_version", 1.0),
        ("to_version", 1.5), ("to_version", "2"), ("to_version", 0),
        ("from_position", -1), ("from_position", "1"), ("consistent", "yes"), ("consistent", 1),
    ],
    ids=repr,
)
async def test_read_arguments_are_checked(store: EventStore, argument: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=argument):
        await store.read(ACCOUNT, **{argument: value})


async def test_a_to_version_before_the_from_version_is_refused(store: EventStore) -> None:
    with pytest.raises(InvalidArgumentError, match="to_version"):
        await store.read(ACCOUNT, from_version=3, to_version=2)


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("from_position", 0), ("from_position", "1"), ("from_position", 1.0), ("to_position", -1),
        ("to_position", "9"), ("batch", 0), ("batch", True), ("batch", 10**9), ("batch", 2.5),
        ("categories", "Account"), ("categories", b"Account"), ("categories", 5),
    ],
    ids=repr,
)
async def test_read_all_arguments_are_checked_at_the_call_even_on_an_empty_stream(
    store: EventStore, argument: str, value: Any
) -> None:
    with pytest.raises(InvalidArgumentError, match=argument):
        store.read_all(**{argument: value})


@pytest.mark.parametrize("categories", [["bad category"], ["Account", "a.b"], ["*"], [">"], [""], [None]], ids=repr)
async def test_bad_category_names_are_refused_on_an_empty_stream(store: EventStore, categories: Any) -> None:
    assert await store.last_position() == 0
    with pytest.raises(InvalidStreamIdError):
        store.read_all(categories=categories)
    with pytest.raises(InvalidStreamIdError):
        store.subscribe(categories=categories)
    with pytest.raises(InvalidStreamIdError):
        await store.pending(0, categories)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("heartbeat_s", math.nan), ("heartbeat_s", math.inf), ("heartbeat_s", 0), ("heartbeat_s", "1"),
     ("heartbeat_s", True), ("batch", -5), ("from_position", None)],
    ids=repr,
)
async def test_subscribe_arguments_are_checked_at_the_call(store: EventStore, argument: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=argument):
        store.subscribe(**{argument: value})


async def test_inspection_arguments_are_checked(store: EventStore) -> None:
    for after in (-1, "1", 1.0, None, True):
        with pytest.raises(InvalidArgumentError, match="after"):
            await store.pending(after)  # type: ignore[arg-type]
    for offset in (-1, "0", 0.0):
        with pytest.raises(InvalidArgumentError, match="offset"):
            await store.catalogue("Account", offset=offset)  # type: ignore[arg-type]
    for limit in (0, "10", 2.0, False):
        with pytest.raises(InvalidArgumentError, match="limit"):
            await store.catalogue("Account", limit=limit)  # type: ignore[arg-type]
    for category in ("bad cat", 5, None):
        with pytest.raises(InvalidStreamIdError):
            await store.catalogue(category)  # type: ignore[arg-type]
    for key in ("", 5, None):
        with pytest.raises(InvalidArgumentError, match="idempotency_key"):
            await store.find_append(ACCOUNT, key)  # type: ignore[arg-type]
    for version, position in ((True, 1), (1, 0), (0, 4), (-1, -1), ("1", 1), (1, 2.0)):
        with pytest.raises(InvalidArgumentError, match="version|position"):
            store.remember(ACCOUNT, version, position)  # type: ignore[arg-type]
    await store.append(ACCOUNT, [Deposited(amount=1)])  # nothing bad was remembered
    assert (await store.state(ACCOUNT)).version == 1


@pytest.mark.parametrize(
    "values",
    [
        {"request_timeout_s": math.inf}, {"request_timeout_s": math.nan}, {"request_timeout_s": 0},
        {"request_timeout_s": 1e-9}, {"duplicate_window_s": math.inf}, {"duplicate_window_s": 0},
        {"append_retries": 10**9}, {"append_retries": -1}, {"stream": "a.b"}, {"stream": "a b"}, {"stream": ""},
        {"stream": "*"}, {"subject_prefix": "a..b"}, {"subject_prefix": "a.>"}, {"replicas": 0},
        {"max_msgs": 0}, {"max_age_s": 60},
    ],
    ids=repr,
)
def test_hostile_settings_are_refused(values: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=next(iter(values))):
        EventStoreSettings(**values)


@pytest.mark.parametrize("text", [None, 5, b"Account/1", ["Account", "1"]], ids=repr)
def test_parse_takes_a_string(text: Any) -> None:
    with pytest.raises(InvalidStreamIdError, match="stream id"):
        StreamId.parse(text)

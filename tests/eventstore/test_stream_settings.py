"""An existing stream is checked against an allow-list of settings: every setting under which an
acknowledged event could vanish, be rewritten or go unacknowledged is refused, and the stream is
never changed. Streams are created through the raw JetStream API, as another tool would."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

from eventstore import EventStore, EventStoreSettings, StreamConfigError, StreamId
from eventstore.stream_check import ALLOWED, REFUSED, config_problems

from ..conftest import unique_settings
from .events import Deposited

S = 10**9  # JetStream durations are nanoseconds


def base_config(settings: EventStoreSettings) -> dict[str, Any]:
    """What a careful operator would create for an event store."""
    return {
        "name": settings.stream, "subjects": [f"{settings.subject_prefix}.>"], "storage": "file",
        "retention": "limits", "deny_delete": True, "deny_purge": True, "allow_direct": True,
        "allow_atomic": True, "duplicate_window": 120 * S, "num_replicas": 1,
    }


async def raw(store: EventStore, verb: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    body = json.dumps(config).encode() if config is not None else b""
    reply = await store.nc.request(f"$JS.API.STREAM.{verb}.{store.settings.stream}", body, timeout=5)
    answer: dict[str, Any] = json.loads(reply.data)
    assert "error" not in answer, answer
    return answer


async def foreign_store(nats_url: str, changes: dict[str, Any]) -> EventStore:
    settings = unique_settings(nats_url)
    store = await EventStore.connect(settings, create_stream=False)
    prefix = settings.subject_prefix
    changes = json.loads(json.dumps(changes).replace("PREFIX", prefix))
    await raw(store, "CREATE", {**base_config(settings), **changes})
    return store


HOSTILE: dict[str, dict[str, Any]] = {
    "max_msgs_per_subject": {"max_msgs_per_subject": 1},
    "max_age": {"max_age": 3600 * S, "discard": "new"},
    "no_ack": {"no_ack": True},
    "retention": {"retention": "interest"},
    "storage": {"storage": "memory"},
    "allow_rollup_hdrs": {"allow_rollup_hdrs": True, "deny_purge": False},
    "allow_msg_ttl": {"allow_msg_ttl": True},
    "subject_delete_marker_ttl": {"allow_msg_ttl": True, "subject_delete_marker_ttl": 60 * S},
    "discard_new_per_subject": {"max_msgs_per_subject": 5, "discard": "new", "discard_new_per_subject": True},
    "subject_transform": {"subject_transform": {"src": "PREFIX.>", "dest": "PREFIX.moved.>"}},
    "allow_msg_counter": {"allow_msg_counter": True},
    "allow_msg_schedules": {"allow_msg_schedules": True},
    "persist_mode": {"persist_mode": "async", "allow_atomic": False},
    "sources": {"sources": [{"name": "SOMEWHERE_ELSE"}]},
    "max_msgs": {"max_msgs": 10, "discard": "old"},
    "max_bytes": {"max_bytes": 10**6, "discard": "old"},
    "deny_delete": {"deny_delete": False},
    "deny_purge": {"deny_purge": False},
    "allow_direct": {"allow_direct": False},
    "allow_atomic": {"allow_atomic": False},
}


@pytest.mark.parametrize("setting", HOSTILE)
async def test_a_stream_that_could_lose_acknowledged_events_is_refused_and_left_unchanged(
    nats_url: str, setting: str
) -> None:
    store = await foreign_store(nats_url, HOSTILE[setting])
    try:
        before = (await raw(store, "INFO"))["config"]
        with pytest.raises(StreamConfigError, match=rf"\b{setting}=") as info:
            await store.ensure_stream()
        assert "never changes an existing stream" in str(info.value)
        assert (await raw(store, "INFO"))["config"] == before
        with pytest.raises(StreamConfigError, match=rf"\b{setting}="):
            await EventStore.connect(store.settings)
    finally:
        await store.close()


async def test_a_sealed_stream_is_refused(nats_url: str) -> None:
    store = await foreign_store(nats_url, {})
    try:
        await raw(store, "UPDATE", {**(await raw(store, "INFO"))["config"], "sealed": True})
        with pytest.raises(StreamConfigError, match=r"\bsealed=True"):
            await store.ensure_stream()
    finally:
        await store.close()


@pytest.mark.parametrize(
    "changes",
    [
        {"max_msgs": 1000, "discard": "new"}, {"max_bytes": 10**8, "discard": "new"}, {"compression": "s2"},
        {"description": "orders", "metadata": {"team": "ops"}}, {"max_msg_size": 10**6}, {"allow_batched": True},
        {"republish": {"src": "PREFIX.>", "dest": "copies.PREFIX.>"}}, {"subjects": ["PREFIX.>", "other.PREFIX"]},
        {"max_consumers": 100},
    ],
    ids=repr,
)
async def test_settings_that_keep_acknowledged_events_are_accepted(nats_url: str, changes: dict[str, Any]) -> None:
    store = await foreign_store(nats_url, changes)
    try:
        await store.ensure_stream()
        store.registry.register(Deposited)
        account = StreamId("Account", "1")
        await store.append(account, [Deposited(amount=1)])
        assert [e.data for e in await store.read(account)] == [Deposited(amount=1)]
    finally:
        await store.close()


async def test_our_own_stream_passes_our_own_check_with_and_without_limits(nats_url: str) -> None:
    for settings in (unique_settings(nats_url), unique_settings(nats_url, max_msgs=5, max_bytes=10**6)):
        async with EventStore.connect(settings) as store:  # creates, then checks what the server made
            config = (await raw(store, "INFO"))["config"]
            assert config_problems(config, f"{settings.subject_prefix}.>") == []


async def test_every_setting_the_server_reports_is_classified(store: EventStore) -> None:
    config = (await raw(store, "INFO"))["config"]
    assert set(config) <= set(ALLOWED) | set(REFUSED)
    assert not set(ALLOWED) & set(REFUSED)
    unknown = config_problems({**config, "brand_new_setting": True}, f"{store.settings.subject_prefix}.>")
    assert len(unknown) == 1 and "brand_new_setting=True" in unknown[0]
    assert config_problems({**config, "brand_new_setting": False}, f"{store.settings.subject_prefix}.>") == []


async def test_max_age_expires_events_even_with_discard_new(nats_url: str) -> None:
    """Why an age limit is refused: 'discard new' does not keep old messages from expiring."""
    store = await foreign_store(nats_url, {"max_age": S, "duplicate_window": S // 2, "discard": "new"})
    try:
        ack = await store.nc.jetstream().publish(f"{store.settings.subject_prefix}.Account.1", b"{}")
        assert ack.seq == 1
        async with asyncio.timeout(10):
            while (await raw(store, "INFO"))["state"]["messages"]:
                await asyncio.sleep(0.2)
    finally:
        await store.close()


async def test_a_full_stream_refuses_appends_and_keeps_every_acknowledged_event(nats_url: str) -> None:
    async with EventStore.connect(unique_settings(nats_url, max_msgs=2)) as store:
        store.registry.register(Deposited)
        accounts = [StreamId("Account", str(i)) for i in range(3)]
        for account in accounts[:2]:
            await store.append(account, [Deposited(amount=1)])
        with pytest.raises(StreamConfigError, match="is full.*Nothing was stored"):
            await store.append(accounts[2], [Deposited(amount=1)])
        assert await store.last_position() == 2
        assert [len(await store.read(a)) for a in accounts] == [1, 1, 0]

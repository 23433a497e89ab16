"""EventStore.subject_counts and consumers: what the server knows of a stream, without reading its messages."""

from __future__ import annotations

import pytest

from eventstore import EventStore, InvalidArgumentError, StreamConfigError, StreamId

from .events import Deposited, Opened


async def test_subject_counts_count_each_entitys_commits(store: EventStore) -> None:
    prefix = store.settings.subject_prefix
    await store.append(StreamId("Account", "a"), [Opened(owner="A")])
    await store.append(StreamId("Account", "a"), [Deposited(amount=1), Deposited(amount=2)])  # one commit
    await store.append(StreamId("Account", "b"), [Opened(owner="B")])
    await store.append(StreamId("Memo", "m"), [Opened(owner="M")])
    assert await store.subject_counts(f"{prefix}.Account.*") == {f"{prefix}.Account.a": 2, f"{prefix}.Account.b": 1}
    assert sum((await store.subject_counts(f"{prefix}.>")).values()) == 4
    assert await store.subject_counts(f"{prefix}.Nothing.*") == {}


async def test_subject_counts_and_consumers_of_a_missing_stream_or_a_bad_argument(store: EventStore) -> None:
    with pytest.raises(StreamConfigError, match="NOPE"):
        await store.subject_counts(">", stream="NOPE")
    with pytest.raises(StreamConfigError, match="NOPE"):
        await store.consumers(stream="NOPE")
    for bad in ("", "a b", 5):
        with pytest.raises(InvalidArgumentError):
            await store.subject_counts(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        await store.consumers(stream="has.dot")


async def test_consumers_lists_durable_consumers_with_their_state(store: EventStore) -> None:
    assert await store.consumers() == []
    await store.append(StreamId("Account", "a"), [Opened(owner="A")])
    config = {"durable_name": "watcher", "ack_policy": "explicit", "metadata": {"team": "ops"}}
    created = await store.durable_consumer("watcher").create(config)
    assert created.error is None, created.description
    [consumer] = await store.consumers()
    assert consumer["name"] == "watcher" and consumer["num_pending"] == 1
    assert consumer["config"]["metadata"]["team"] == "ops"

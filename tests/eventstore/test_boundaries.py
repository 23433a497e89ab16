"""Where a read may end: commit boundaries asked from the stream's leader never cut an atomic batch."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from pydantic import BaseModel

from eventstore import ConnectionSecurity, EntityAppend, EventStore, StreamConfigError, StreamId
from eventstore.jetstream import BulkConnection, last_commit_boundary, whole_commits_end


class Noted(BaseModel):
    n: int


@pytest.fixture
async def conn(store: EventStore) -> AsyncIterator[BulkConnection]:
    assert store.settings.nats_url is not None
    store.registry.register(Noted)
    connection = await BulkConnection.open([store.settings.nats_url], ConnectionSecurity(), deadline_s=5)
    try:
        yield connection
    finally:
        connection.close()


async def batch(store: EventStore, size: int) -> list[int]:
    """One atomic append over ``size`` entities: the positions it took."""
    results = await store.append_many(
        [EntityAppend(StreamId("Ledger", f"e{i}-{size}"), [Noted(n=i)]) for i in range(size)]
    )
    return [r.position for r in results]


async def single(store: EventStore, n: int) -> int:
    return (await store.append(StreamId("Ledger", f"single-{n}"), [Noted(n=n)])).position


async def test_an_empty_stream_ends_at_zero(store: EventStore, conn: BulkConnection) -> None:
    assert await last_commit_boundary(conn, store.settings.stream, timeout_s=5) == 0


async def test_the_last_boundary_is_the_last_commit(store: EventStore, conn: BulkConnection) -> None:
    await single(store, 1)
    positions = await batch(store, 4)
    assert await last_commit_boundary(conn, store.settings.stream, timeout_s=5) == positions[-1]


async def test_a_bound_inside_an_atomic_batch_ends_the_run_before_the_batch(
    store: EventStore, conn: BulkConnection
) -> None:
    first = await single(store, 1)  # position 1
    second = await single(store, 2)  # 2
    inside = await batch(store, 5)  # 3..7
    after = await single(store, 3)  # 8
    stream = store.settings.stream
    assert (first, second, inside, after) == (1, 2, [3, 4, 5, 6, 7], 8)
    for at_most in (3, 4, 5, 6):
        assert await whole_commits_end(conn, stream, 0, at_most, timeout_s=5) == 2
    assert await whole_commits_end(conn, stream, 0, 7, timeout_s=5) == 7  # the batch's commit: whole
    assert await whole_commits_end(conn, stream, 0, 8, timeout_s=5) == 8
    assert await whole_commits_end(conn, stream, 0, 1, timeout_s=5) == 1


async def test_a_batch_longer_than_the_bound_is_read_whole(store: EventStore, conn: BulkConnection) -> None:
    await single(store, 1)  # 1
    await batch(store, 6)  # 2..7
    await single(store, 2)  # 8
    stream = store.settings.stream
    for at_most in range(2, 8):
        assert await whole_commits_end(conn, stream, 1, at_most, timeout_s=5) == 7
    with pytest.raises(ValueError):
        await whole_commits_end(conn, stream, 3, 3, timeout_s=5)


async def test_a_missing_stream_is_a_stream_config_error(conn: BulkConnection) -> None:
    with pytest.raises(StreamConfigError, match="does not exist"):
        await last_commit_boundary(conn, "NO_SUCH_STREAM", timeout_s=5)
    with pytest.raises(StreamConfigError, match="does not exist"):
        await whole_commits_end(conn, "NO_SUCH_STREAM", 0, 5, timeout_s=5)

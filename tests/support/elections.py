"""Elections on a test cluster: kill the node that leads JetStream's meta group (and, if asked, a stream too).

A process started just after that meets the elections at once: the meta
group's (stream, consumer and bucket creation wait for it: requests are
dropped for 5-10 s) and, when the stream's leader died too, the stream's (its
reads wait for it). A new meta leader that has not yet heard from the dead
node answers "no suitable peers for placement, peer offline" to the creation
of a replica on every node until that node is back: :func:`leader_killed`
brings it back after a while, as an operator (or a supervisor) would.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats

from eventstore import EmbeddedCluster


async def kill_the_leader(cluster: EmbeddedCluster, stream: str, *, of_the_stream: bool = True) -> int:
    """Kill (SIGKILL) the meta leader's node, once it leads ``stream`` too (``of_the_stream``) or once another
    node does; return its index. Leaderships are moved with stream leader step-downs (a preferred node).

    Raises AssertionError when the leaderships cannot be arranged within 30 s.
    """
    deadline = time.monotonic() + 30
    nc = await nats.connect(cluster.urls, connect_timeout=2, max_reconnect_attempts=0)
    try:
        while True:
            meta = await asyncio.to_thread(cluster.meta_leader)
            leader = await asyncio.to_thread(cluster.stream_leader, stream)
            if meta is not None and leader is not None and (meta == leader) == of_the_stream:
                cluster.kill(meta)
                return meta
            assert time.monotonic() < deadline, f"stream {stream} led by {leader}, meta group by {meta}"
            if meta is not None and leader is not None:
                target = meta if of_the_stream else next(i for i in cluster.running() if i != meta)
                body = {"placement": {"preferred": EmbeddedCluster.node_name(target)}}
                try:
                    await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", json.dumps(body).encode(), timeout=2)
                except nats.errors.Error:
                    pass  # asked again below
            await asyncio.sleep(0.5)
    finally:
        await nc.close()


@asynccontextmanager
async def leader_killed(
    cluster: EmbeddedCluster, stream: str, *, of_the_stream: bool = True, back_after_s: float = 10.0
) -> AsyncIterator[int]:
    """:func:`kill_the_leader`, and the node started again ``back_after_s`` later; on leaving, waits until it is."""
    index = await kill_the_leader(cluster, stream, of_the_stream=of_the_stream)

    async def back() -> None:
        await asyncio.sleep(back_after_s)
        await asyncio.to_thread(cluster.start_node, index)

    restart = asyncio.ensure_future(back())
    try:
        yield index
    finally:
        await restart  # not cancelled: the next test's cluster fixture must not race a node starting

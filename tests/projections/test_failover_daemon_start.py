"""The daemon starts while JetStream elects a leader: it waits for its stream and its lease bucket, then applies
every event, instead of exiting; a stop ends that wait at once."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from eventstore import EmbeddedCluster, EventStore, EventStoreSettings
from projections import Daemon, Outcome

from projection_examples import AccountBalances, append_workload, register_all, workload
from projection_helpers import dump, make_settings, memory_fold
from tests.support.elections import leader_killed
from tests.support.proxy import Proxy


@pytest.mark.parametrize("of_the_stream", [True, False], ids=["stream-and-meta-leader", "meta-leader"])
async def test_a_daemon_starts_while_its_stream_and_lease_bucket_elect_a_leader(
    cluster: EmbeddedCluster, tmp_path: Path, of_the_stream: bool
) -> None:
    tag = uuid.uuid4().hex[:10]
    store_settings = EventStoreSettings(nats_url=cluster.url, stream=f"P{tag}", subject_prefix=f"p{tag}",
                                        replicas=3, request_timeout_s=1.0)
    settings = make_settings(cluster.url, tmp_path / "read-models.sqlite3", eventstore=store_settings)
    async with await EventStore.connect(store_settings) as es:
        register_all(es)
        await append_workload(es, workload(60, accounts=10))
        # The node killed leads the meta group (and the stream): the lease bucket's creation waits for the meta
        # group's election (5-10 s, then perhaps "no suitable peers" until the node is back, 10 s later; one
        # request times out after 1 s), the stream check for the stream's.
        async with leader_killed(cluster, store_settings.stream, of_the_stream=of_the_stream):
            async with asyncio.timeout(90):
                outcomes = await Daemon([AccountBalances()], settings).run(until_caught_up=True)
        assert outcomes == {"account_balances": Outcome.CAUGHT_UP}
        applied = dump(settings, "account_balances")
        assert applied["balances"] and applied == await memory_fold(AccountBalances(), es)


async def test_a_daemon_stopped_while_it_waits_for_jetstream_stops_at_once(nats_url: str, tmp_path: Path) -> None:
    async with Proxy(nats_url) as proxy:
        proxy.drop_replies(1.0)  # connected, but JetStream's answers never come
        tag = uuid.uuid4().hex[:10]
        settings = make_settings(proxy.url, tmp_path / "read-models.sqlite3", eventstore=EventStoreSettings(
            nats_url=proxy.url, stream=f"P{tag}", subject_prefix=f"p{tag}", request_timeout_s=5.0))
        daemon = Daemon([AccountBalances()], settings)
        running = asyncio.ensure_future(daemon.run())
        await asyncio.sleep(1.5)
        assert not running.done(), running
        daemon.stop()
        started = time.monotonic()
        async with asyncio.timeout(10):
            assert await running == {"account_balances": Outcome.STOPPED}
        assert time.monotonic() - started < 1.5

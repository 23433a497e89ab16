"""Benchmark of projections: rebuild throughput against raw nats-py replay, and live latency.

Starts its own nats-server in a temporary directory, writes 200,000 single-event
commits (10,000 accounts), then measures:

* ``raw_replay_eps``: the fastest raw nats-py replay of the stream (best of an
  ordered push consumer with a callback and raw ``$JS.API.CONSUMER.MSG.NEXT``
  pulls on a plain subscription callback, the latter run before and after the
  rebuild), counting messages only;
* ``rebuild_eps``: :func:`projections.rebuild` of a balance projection (decode
  the event, get the row, one upsert per event) into a fresh SQLite file,
  including the shadow creation and the switch;
* ``live_p50_ms`` / ``live_p99_ms``: a daemon (``jetsourcing run`` in a
  subprocess) follows the stream; one event is appended at a time (light
  load) and the time until its effect is visible to a SQLite reader is taken.

``*_cpu_eps`` and ``rebuild_vs_raw_cpu`` give the same comparison in client
CPU time, which other processes on a shared machine disturb much less than
wall-clock time. Progress goes to stderr; the last line of stdout is one JSON
object.
Run: ``.venv/bin/python benchmarks/bench_projections.py [--events N] [--live N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eventstore import EmbeddedServer, EventStore, EventStoreSettings, RecordedEvent, StreamId, encode_commit  # noqa: E402
from eventstore.wire import utc_now_text  # noqa: E402
from projections import Projection, ProjectionSettings, Table, Transaction, handles, rebuild  # noqa: E402

ACCOUNTS = 10_000


class Deposited(BaseModel):
    amount: int


class Balances(Projection):
    """A realistic read model: per event, decode it, read the account's row, upsert it."""

    name = "bench_balances"
    categories = ("Account",)
    tables = (
        Table("balances", key="account_id",
              columns={"account_id": str, "balance": int, "deposits": int, "last_position": int}),
    )

    @handles(Deposited)
    def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
        data = event.data
        assert isinstance(data, Deposited)
        account = event.stream_id.entity_id
        row = tx.get("balances", account) or {"balance": 0, "deposits": 0}
        row["balance"] += data.amount
        row["deposits"] += 1
        row["last_position"] = event.position
        tx.upsert("balances", account, row)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def populate(store: EventStore, count: int) -> None:
    """Write ``count`` single-event commits in the event store's wire format (core publishes, checked by count)."""
    prefix = store.settings.subject_prefix
    versions: dict[int, int] = {}
    started = time.perf_counter()
    for i in range(count):
        account = i % ACCOUNTS
        version = versions.get(account, 0) + 1
        versions[account] = version
        headers, body = encode_commit(
            msg_id=uuid.uuid4().hex, types=["Deposited"], schema_versions=[1], event_ids=[uuid.uuid4().hex],
            payloads=[b'{"amount":%d}' % (i % 1000 + 1)], last_version=version, recorded_at=utc_now_text(),
        )
        await store.nc.publish(StreamId("Account", f"acc-{account:05d}").subject(prefix), body, headers=headers)
        if i % 5000 == 4999:
            await store.nc.flush()
            say(f"populate: {i + 1:,}/{count:,}")
    await store.nc.flush()
    while await store.last_position() < count:
        await asyncio.sleep(0.05)
    say(f"populate: {count:,} events in {time.perf_counter() - started:.1f}s")


async def raw_pull_replay(store: EventStore, count: int) -> float:
    """Raw $JS.API.CONSUMER.MSG.NEXT pulls answered into a plain subscription callback."""
    nc = store.nc
    stream = store.settings.stream
    received = 0
    done = asyncio.Event()

    async def on_msg(msg: object) -> None:
        nonlocal received
        received += 1
        if received >= count:
            done.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
    name = "rawpull" + uuid.uuid4().hex[:8]
    config = {"name": name, "deliver_policy": "all", "ack_policy": "none", "mem_storage": True,
              "inactive_threshold": 60_000_000_000}
    started = time.perf_counter()
    await nc.request(f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
                     json.dumps({"stream_name": stream, "config": config}).encode())
    await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}",
                     json.dumps({"batch": count, "expires": 120_000_000_000}).encode(), reply=inbox)
    await done.wait()
    eps = count / (time.perf_counter() - started)
    await sub.unsubscribe()
    await nc.request(f"$JS.API.CONSUMER.DELETE.{stream}.{name}", b"")
    return eps


async def raw_push_replay(store: EventStore, count: int) -> float:
    """An ordered push consumer (nats-py's own) with a callback."""
    js = store.nc.jetstream()
    received = 0
    done = asyncio.Event()

    async def on_msg(msg: object) -> None:
        nonlocal received
        received += 1
        if received >= count:
            done.set()

    started = time.perf_counter()
    sub = await js.subscribe(f"{store.settings.subject_prefix}.>", cb=on_msg, ordered_consumer=True,
                             pending_msgs_limit=-1, pending_bytes_limit=-1)
    await done.wait()
    eps = count / (time.perf_counter() - started)
    await sub.unsubscribe()
    return eps


def wait_visible(db: Path, account: str, deposits: int, timeout_s: float = 10.0) -> float:
    """Poll a reader connection until ``account`` shows ``deposits``; returns the perf_counter time seen."""
    conn = sqlite3.connect(db)
    deadline = time.perf_counter() + timeout_s
    try:
        while True:
            try:
                row = conn.execute("SELECT deposits FROM balances WHERE account_id = ?", (account,)).fetchone()
            except sqlite3.OperationalError:
                row = None
            now = time.perf_counter()
            if row and row[0] >= deposits:
                return now
            if now > deadline:
                raise TimeoutError(f"{account} did not reach {deposits} deposits")
            time.sleep(0.0002)
    finally:
        conn.close()


async def live_latency(store: EventStore, settings: ProjectionSettings, samples: int) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_")}
    env.update({
        "NATS_URL": str(settings.eventstore.nats_url),
        "JETSOURCING_STREAM": settings.eventstore.stream,
        "JETSOURCING_SUBJECT_PREFIX": settings.eventstore.subject_prefix,
        "JETSOURCING_DATABASE": str(settings.database),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(ROOT)]),
    })
    daemon = subprocess.Popen([sys.executable, "-m", "projections.cli", "run", "bench_projections:Balances",
                               "--log-level", "WARNING"], env=env, cwd=ROOT)
    try:
        last = await store.last_position()
        db = settings.database
        account = StreamId("Account", "live-probe")
        store.registry.register(Deposited) if "Deposited" not in store.registry else None
        # Wait for the daemon to have caught up with the rebuilt model.
        await store.append(account, [Deposited(amount=1)])
        await asyncio.to_thread(wait_visible, db, "live-probe", 1, 120.0)
        say(f"live: daemon caught up past {last:,}")
        latencies = []
        for i in range(2, samples + 2):
            await asyncio.sleep(0.02)  # light load: ~50 appends/s
            started = time.perf_counter()
            seen = asyncio.create_task(asyncio.to_thread(wait_visible, db, "live-probe", i))
            await store.append(account, [Deposited(amount=1)])
            latencies.append((await seen) - started)
        latencies.sort()
        p50 = latencies[len(latencies) // 2] * 1000
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000
        say(f"live: {samples} appends, p50 {p50:.2f} ms, p99 {p99:.2f} ms")
        return p50, p99
    finally:
        daemon.terminate()
        daemon.wait(30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--live", type=int, default=300, help="live latency samples")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-projections-") as tmp, EmbeddedServer(Path(tmp) / "nats") as server:
        es_settings = EventStoreSettings(nats_url=server.url, stream="BENCH", subject_prefix="bench")
        settings = ProjectionSettings(eventstore=es_settings, database=Path(tmp) / "read-models.sqlite3")
        store = await EventStore.connect(es_settings)
        try:
            await populate(store, args.events)
            raws: dict[str, tuple[float, float]] = {}  # name -> (wall events/s, client CPU events/s)

            async def raw_run(name: str, replay: Callable[[EventStore, int], Awaitable[float]]) -> None:
                cpu = time.process_time()
                wall = await replay(store, args.events)
                cpu_eps = args.events / (time.process_time() - cpu)
                best = raws.get(name, (0.0, 0.0))
                raws[name] = (max(best[0], wall), max(best[1], cpu_eps))
                say(f"raw replay ({name}): {wall:,.0f} events/s (client CPU: {cpu_eps:,.0f} events/s)")

            await raw_run("MSG.NEXT pulls, callback", raw_pull_replay)
            await raw_run("ordered push consumer, callback", raw_push_replay)
            cpu = time.process_time()
            result = await rebuild(Balances(), settings, event_store=store)
            rebuild_cpu_eps = args.events / (time.process_time() - cpu)
            rebuild_eps = args.events / result.seconds
            # Raw again after the rebuild, so a load change on a shared machine does not favour the rebuild.
            await raw_run("MSG.NEXT pulls, callback", raw_pull_replay)
            pull, pull_cpu = raws["MSG.NEXT pulls, callback"]
            push, push_cpu = raws["ordered push consumer, callback"]
            raw, raw_cpu = max(pull, push), max(pull_cpu, push_cpu)
            say(f"rebuild: {result.events:,} events in {result.seconds:.2f}s = {rebuild_eps:,.0f} events/s "
                f"({rebuild_eps / raw:.2f} x raw; client CPU {rebuild_cpu_eps:,.0f} events/s = "
                f"{rebuild_cpu_eps / raw_cpu:.2f} x raw)")
            p50, p99 = await live_latency(store, settings, args.live)
        finally:
            await store.close()
    print(json.dumps({
        "events": args.events,
        "raw_replay_eps": round(raw),
        "raw_pull_eps": round(pull),
        "raw_push_eps": round(push),
        "rebuild_eps": round(rebuild_eps),
        "rebuild_vs_raw": round(rebuild_eps / raw, 3),
        "raw_replay_cpu_eps": round(raw_cpu),
        "rebuild_cpu_eps": round(rebuild_cpu_eps),
        "rebuild_vs_raw_cpu": round(rebuild_cpu_eps / raw_cpu, 3),
        "live_p50_ms": round(p50, 2),
        "live_p99_ms": round(p99, 2),
    }))


if __name__ == "__main__":
    asyncio.run(main())

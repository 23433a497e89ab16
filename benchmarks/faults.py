"""Faults report: what survives a killed server, a killed stream leader, a lost follower and killed clients.

Run: ``.venv/bin/python benchmarks/faults.py`` (``--quick`` for a smaller run). Not a timed test: it runs the
scenarios of the fault tests (``tests/support/workload.py``) at a larger scale, on real processes, and counts.
Progress goes to stderr; the last stdout line is one JSON object with a key per scenario (``single_kill``,
``cluster_leader_kill``, ``follower_loss``, ``client_kill``), each holding ``acked``, ``stored``, ``lost``,
``duplicated``, ``partial_commands``, ``errors_by_type``, ``outage_s`` and ``recovery_s`` (from the server or a
new leader being back to the first acknowledged append), and ``append_r3_vs_r1``: pipelined append throughput on
an R3 cluster over one server (R1), the framework's and raw nats-py's, in interleaved rounds (median ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats  # noqa: E402

from eventstore import ANY, EmbeddedCluster, EmbeddedServer, EventStore, EventStoreSettings, StreamId  # noqa: E402
from tests.support.workload import (  # noqa: E402
    Report,
    Step,
    Workload,
    check,
    kill_clients,
    kill_server,
)

FIELDS = ("acked", "stored", "lost", "duplicated", "partial_commands", "errors_by_type")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def settings_for(url: str, **overrides: Any) -> EventStoreSettings:
    tag = uuid.uuid4().hex[:8]
    values: dict[str, Any] = {"nats_url": url, "stream": f"FAULTS{tag}", "subject_prefix": f"faults{tag}",
                              "request_timeout_s": 2.0}
    values.update(overrides)
    return EventStoreSettings(**values)


def summary(report: Report, outage_s: float | None, recovery_s: float | None) -> dict[str, Any]:
    out = {key: getattr(report, key) for key in FIELDS}
    out["outage_s"] = None if outage_s is None else round(outage_s, 2)
    out["recovery_s"] = None if recovery_s is None else round(recovery_s, 2)
    return out


async def settle(workload: Workload, seconds: float) -> None:
    started, acked = time.monotonic(), len(workload.ledger.acked)
    while time.monotonic() - started < seconds:
        await asyncio.sleep(1.0)
        log(f"  ... {len(workload.ledger.acked)} commands acknowledged, errors {dict(workload.ledger.errors)}")
    log(f"  {len(workload.ledger.acked) - acked} commands in {seconds:.0f}s")


async def single_kill(scale: int, base: Path) -> dict[str, Any]:
    log("single_kill: SIGKILL one nats-server under writers, restart it on the same storage")
    server = EmbeddedServer(base / "single").start()
    try:
        store = await EventStore.connect(settings_for(server.url))
        workload = Workload(store, entities=500 * scale, writers=32, seed=1)
        workload.start()
        await settle(workload, 3)
        outage = await kill_server(server, workload.ledger, down_s=3.0)
        log(f"  back: first append {outage['recovery_s']:.2f}s after the restart")
        await settle(workload, 3)
        await workload.stop()
        report = await check(store, workload.ledger)
        await store.close()
        return summary(report, outage["outage_s"], outage["recovery_s"])
    finally:
        server.close()


async def first_ack_after(workload: Workload, t: float, timeout_s: float = 60.0) -> float:
    while (first := workload.ledger.first_ack_after(t)) is None:
        if time.monotonic() - t > timeout_s:
            raise AssertionError(f"no append acknowledged within {timeout_s}s")
        await asyncio.sleep(0.01)
    return first


async def r3_workload(cluster: EmbeddedCluster, scale: int, seed: int) -> tuple[EventStore, Workload, int]:
    """32 writers on a new R3 stream, settled for 2 s; the store, the workload and the stream's leader."""
    settings = settings_for(cluster.url, replicas=3)
    store = await EventStore.connect(settings)
    workload = Workload(store, entities=500 * scale, writers=32, seed=seed)
    workload.start()
    await settle(workload, 2)
    return store, workload, await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)


async def r3_report(cluster: EmbeddedCluster, store: EventStore, workload: Workload) -> Report:
    """Stop the writers, bring every node back (JetStream's meta group may have lost its leader), read back."""
    await workload.stop()
    await asyncio.to_thread(cluster.start)
    report = await check(store, workload.ledger)
    await store.close()
    return report


async def cluster_leader_kill(cluster: EmbeddedCluster, scale: int) -> dict[str, Any]:
    log("cluster_leader_kill: SIGKILL the R3 stream's leader under writers")
    store, workload, leader = await r3_workload(cluster, scale, seed=2)
    cluster.kill(leader)
    killed = time.monotonic()
    await asyncio.to_thread(cluster.wait_for_stream_leader, store.settings.stream, other_than=leader, timeout_s=60)
    elected = time.monotonic()
    first = await first_ack_after(workload, elected)
    log(f"  new leader {elected - killed:.2f}s after the kill; first append {first - elected:.2f}s after that")
    await settle(workload, 3)
    result = summary(await r3_report(cluster, store, workload), first - killed, first - elected)
    result["election_s"] = round(elected - killed, 2)
    return result


async def follower_loss(cluster: EmbeddedCluster, scale: int) -> dict[str, Any]:
    log("follower_loss: SIGKILL a follower under writers, bring it back")
    store, workload, leader = await r3_workload(cluster, scale, seed=3)
    follower = next(i for i in cluster.running() if i != leader)
    cluster.kill(follower)
    lost = time.monotonic()
    first = await first_ack_after(workload, lost)
    await settle(workload, 3)
    cluster.start_node(follower)
    back = time.monotonic()
    await settle(workload, 2)
    log(f"  first append {first - lost:.2f}s after the loss; the follower was back at +{back - lost:.1f}s")
    return summary(await r3_report(cluster, store, workload), first - lost, first - lost)


async def client_kill(url: str, scale: int, base: Path) -> dict[str, Any]:
    log("client_kill: SIGKILL client processes in the middle of append_many over hundreds of entities")
    store = await EventStore.connect(settings_for(url))
    store.registry.register(Step)
    report = await kill_clients(store, base / "client-acked.txt", kills=5 * scale, seed=4)
    await store.close()
    log(f"  {report.acked} batches acknowledged, {report.reads} concurrent reads")
    result = summary(report, None, None)
    result["concurrent_reads"] = report.reads
    return result


async def append_rate(url: str, replicas: int, count: int, raw: bool) -> float:
    """Appends per second with 64 appends in flight (64 tasks, each on its own entities)."""
    settings = settings_for(url, replicas=replicas)
    store = await EventStore.connect(settings)
    store.registry.register(Step)
    per_task = count // 64
    event = [Step(command="c", part=0, parts=1, entities=["x"])]
    nc = await nats.connect(url.split(","))
    js = nc.jetstream(timeout=settings.request_timeout_s)
    body = event[0].model_dump_json().encode()

    async def writer(t: int) -> None:
        for n in range(per_task):
            if raw:
                await js.publish(f"{settings.subject_prefix}.Bench.t{t}", body)
            else:
                await store.append(StreamId("Bench", f"t{t}-{n % 8}"), event, ANY)

    started = time.perf_counter()
    await asyncio.gather(*(writer(t) for t in range(64)))
    rate = per_task * 64 / (time.perf_counter() - started)
    await nc.close()
    await store.close()
    return rate


async def r3_vs_r1(cluster: EmbeddedCluster, single_url: str, rounds: int, count: int) -> dict[str, Any]:
    log(f"append_r3_vs_r1: {rounds} interleaved rounds of {count} pipelined appends each")
    ratios: dict[str, list[float]] = {"framework": [], "raw": []}
    rates: dict[str, list[float]] = {"framework_r1": [], "framework_r3": [], "raw_r1": [], "raw_r3": []}
    for r in range(rounds):
        for raw in (False, True):
            kind = "raw" if raw else "framework"
            r1 = await append_rate(single_url, 1, count, raw)
            r3 = await append_rate(cluster.url, 3, count, raw)
            rates[f"{kind}_r1"].append(r1)
            rates[f"{kind}_r3"].append(r3)
            ratios[kind].append(r3 / r1)
            log(f"  round {r + 1} {kind}: R1 {r1:,.0f}/s, R3 {r3:,.0f}/s, ratio {r3 / r1:.2f}")
    return {
        "ratio": round(statistics.median(ratios["framework"]), 3),
        "raw_ratio": round(statistics.median(ratios["raw"]), 3),
        "rounds": [round(x, 3) for x in ratios["framework"]],
        **{f"{k}_eps": round(statistics.median(v)) for k, v in rates.items()},
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run")
    args = parser.parse_args()
    scale = 1 if args.quick else 2
    rounds, count = (3, 2000) if args.quick else (5, 6000)
    results: dict[str, Any] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="jetsourcing-faults-") as tmp:
        base = Path(tmp)
        results["single_kill"] = await single_kill(scale, base)
        with EmbeddedServer(base / "r1") as single, EmbeddedCluster(3, base / "cluster") as cluster:
            results["cluster_leader_kill"] = await cluster_leader_kill(cluster, scale)
            results["follower_loss"] = await follower_loss(cluster, scale)
            results["client_kill"] = await client_kill(single.url, scale, base)
            results["append_r3_vs_r1"] = await r3_vs_r1(cluster, single.url, rounds, count)
    scenarios = ("single_kill", "cluster_leader_kill", "follower_loss", "client_kill")
    results["all_zero"] = all(
        results[s][k] == 0 for s in scenarios for k in ("lost", "duplicated", "partial_commands")
    )
    results["config_errors"] = sum(
        n for s in scenarios for name, n in results[s]["errors_by_type"].items() if "Config" in name
    )
    results["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main())

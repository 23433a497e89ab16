"""Benchmark of dynamic consistency boundaries (``store.dcb``): conditional appends, reads by query, storage.

Run with the project's venv: ``.venv/bin/python benchmarks/bench_dcb.py [--quick]``. Starts its own
nats-server in a temporary directory; prints progress to stderr and one JSON object as the last line of stdout.

* ``dcb_append_over_entity_append``, keyed by the stream's replicas ("replicas_1": the embedded server;
  "replicas_3": a 3-node embedded cluster): 16 writers, each appending one event at a time: per-entity
  appends with an expected version (each writer its own entity), against DCB appends of one event tagged with
  two tags under a condition of a two-item query (one item per tag) after the writer's previous append.
  Measured in 5 interleaved rounds; the median of the rounds' ratios (``appends`` has every round).
  ``decision_eps``: :class:`aggregates.Decisions` commands (read the two-item query, decide, append under its
  condition), same writers, same rounds: what a command costs. A DCB append is an atomic batch (its commit and
  index messages); nats-server stages an atomic batch of a one-replica file stream in a file store it creates
  on disk for that batch (``newBatchStore``), of a replicated stream in memory: so on one replica a DCB append
  (as any ``append_many``) costs some milliseconds of the server's, on three about what an entity append does.
* ``raw_batch3_over_raw_single``, keyed the same: the same 16 writers with plain nats-py, no jetsourcing: an
  atomic batch of three messages (two empty, then the checked one, as a DCB append of two tags stores) against
  one checked message; the server's own price for a batch, so the ceiling of ``dcb_append_over_entity_append``.
* ``dcb_read_p50_ms`` keyed "20000" and "1000000" (100000 with ``--quick``): ``read(query)`` (a new
  process's: nothing remembered) of a two-tag query item matching 100 events spread evenly through a stream of
  that many messages (the rest: entity commits of 20,000 other entities), appended as decisions append them
  (under a condition on the item); ``entity_load_p50_ms``: ``EventStore.read`` of entities of 100 commits
  spread the same way in the same streams; ``dcb_read_over_entity_load``: the ratio per stream (median of the
  5 interleaved rounds' p50 ratios); ``dcb_read_growth``: the big stream's p50 over the small one's.
* ``storage``: messages and bytes the stream holds per DCB event (tagged with two tags, appended under a
  two-item condition) and per entity event, from the stream's own counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import time
import uuid
from typing import Any

from pydantic import BaseModel

from aggregates import Decisions, Fold
from eventstore import (
    AppendCondition,
    EmbeddedCluster,
    EmbeddedServer,
    EventStore,
    EventStoreSettings,
    Query,
    StreamId,
    TaggedEvent,
)
from harness import Noise, progress, run  # this script's folder is on sys.path

WRITERS = 16
ROUNDS = 5


class Enrolled(BaseModel):
    student: str
    course: str


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


async def connect(url: str, name: str, replicas: int = 1) -> EventStore:
    settings = EventStoreSettings(nats_url=url, stream=name.upper(), subject_prefix=name, replicas=replicas)
    store = await EventStore.connect(settings)
    store.registry.register(Enrolled)
    await store.dcb.ensure_index()
    return store


def tagged(writer: int, n: int) -> TaggedEvent:
    return TaggedEvent(Enrolled(student=f"s{writer}", course=f"c{writer}"), {f"course:{writer}", f"student:{writer}"})


def two_items(writer: int) -> Query:
    return Query.of(tags=[f"course:{writer}"]) | Query.of(tags=[f"student:{writer}"])


# -- appends ------------------------------------------------------------------------------------------------------


async def entity_appends(store: EventStore, versions: list[int], count: int) -> float:
    async def writer(w: int) -> None:
        for _ in range(count // WRITERS):
            result = await store.append(StreamId("Writer", f"w{w}"), [Enrolled(student="s", course="c")], versions[w])
            versions[w] = result.last_version

    started = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(WRITERS)))
    return count / (time.perf_counter() - started)


async def dcb_appends(store: EventStore, positions: list[int], count: int) -> float:
    async def writer(w: int) -> None:
        for n in range(count // WRITERS):
            result = await store.dcb.append([tagged(w, n)], condition=AppendCondition(two_items(w), positions[w]))
            positions[w] = result.position

    started = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(WRITERS)))
    return count / (time.perf_counter() - started)


async def decisions(store: EventStore, count: int) -> float:
    model = Decisions(store)

    async def writer(w: int) -> None:
        own = WRITERS + w  # tags of its own: the plain appends' writers keep theirs
        fold = Fold(two_items(own), 0, lambda n, _: n + 1)
        for n in range(count // WRITERS):
            await model.execute({"seen": fold}, lambda state: [tagged(own, n)])

    started = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(WRITERS)))
    return count / (time.perf_counter() - started)


async def raw_appends(store: EventStore, last: list[int], count: int, batch: int) -> float:
    """Plain nats-py, no jetsourcing: each writer's message checked against its subject's last sequence, alone
    (``batch`` 1) or committing an atomic batch after ``batch - 1`` empty messages: what the server charges."""
    nc, prefix = store.nc, f"{store.settings.subject_prefix}.Raw"

    async def writer(w: int) -> None:
        for _ in range(count // WRITERS):
            headers = {"Nats-Expected-Last-Subject-Sequence": str(last[w])}
            if batch > 1:
                batch_id = uuid.uuid4().hex
                for i in range(1, batch):
                    await nc.publish(f"{prefix}.x{w}", b"", headers={"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(i)})
                headers.update({"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(batch), "Nats-Batch-Commit": "1"})
            reply = await nc.request(f"{prefix}.w{w}", b'{"student":"s","course":"c"}', timeout=30, headers=headers)
            ack = json.loads(reply.data)
            assert "seq" in ack, ack
            last[w] = ack["seq"]

    started = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(WRITERS)))
    return count / (time.perf_counter() - started)


async def append_rates(url: str, replicas: int, quick: bool) -> dict[str, Any]:
    """Appends per second of each kind, in interleaved rounds, on a stream of ``replicas``."""
    # Fewer DCB appends where they are slow (one replica: see the module docs); rates do not depend on counts.
    entity_count = 800 if quick else 3200
    count, decided = (entity_count, entity_count // 4) if replicas > 1 else (entity_count // 8, entity_count // 16)
    store = await connect(url, f"appends{replicas}", replicas)
    result: dict[str, Any] = {}
    try:
        versions, positions, raw_single, raw_batch = [0] * WRITERS, [0] * WRITERS, [0] * WRITERS, [0] * WRITERS
        await entity_appends(store, versions, WRITERS * 10)  # warm up: connections, caches
        await dcb_appends(store, positions, WRITERS * 10)
        rounds = []
        for r in range(ROUNDS):  # interleaved: each round runs every kind, so noise hits all alike
            entity = await entity_appends(store, versions, entity_count)
            dcb = await dcb_appends(store, positions, count)
            decide = await decisions(store, decided)
            single = await raw_appends(store, raw_single, entity_count, 1)
            batched = await raw_appends(store, raw_batch, count, 3)
            rounds.append({"entity_eps": round(entity), "dcb_eps": round(dcb), "decision_eps": round(decide),
                           "ratio": round(dcb / entity, 3), "raw_single_eps": round(single),
                           "raw_batch3_eps": round(batched), "raw_ratio": round(batched / single, 3)})
            progress(f"append round {r}, {replicas} replica(s): {rounds[-1]}")
        result["rounds"] = rounds
        result["entity_append_eps"] = round(p50([r["entity_eps"] for r in rounds]))
        result["dcb_append_eps"] = round(p50([r["dcb_eps"] for r in rounds]))
        result["decision_eps"] = round(p50([r["decision_eps"] for r in rounds]))
        result["dcb_append_over_entity_append"] = round(p50([r["ratio"] for r in rounds]), 3)
        # The same comparison without jetsourcing: the ceiling of the ratio above, set by the server.
        result["raw_batch3_over_raw_single"] = round(p50([r["raw_ratio"] for r in rounds]), 3)
    finally:
        await store.close()
    return result


# -- storage ------------------------------------------------------------------------------------------------------


async def storage(url: str, result: dict[str, Any]) -> None:
    count = 500
    figures = {}
    for kind in ("dcb", "entity"):
        store = await connect(url, f"cost{kind}")
        try:
            position = 0
            for n in range(count):
                if kind == "dcb":
                    position = (await store.dcb.append([tagged(n % 10, n)],
                                                       condition=AppendCondition(two_items(n % 10), position))).position
                else:
                    await store.append(StreamId("Writer", f"w{n % 10}"), [Enrolled(student=f"s{n % 10}", course=f"c{n % 10}")])
            info = await store.info()
            figures[kind] = {"messages_per_event": round(info.commits / count, 3), "bytes_per_event": round(info.bytes / count)}
        finally:
            await store.close()
    result["storage"] = figures
    progress(f"storage {figures}")


# -- reads --------------------------------------------------------------------------------------------------------


class ReadStream:
    """A stream of ``size`` messages: entity commits of 20,000 noise entities, with the measured DCB events (100
    per query target) and entity commits (100 per entity target) appended evenly between slices of them."""

    def __init__(self, store: EventStore, targets: int) -> None:
        self.store = store
        self.targets = targets
        self._noise = Noise(store.settings.subject_prefix, "Enrolled", b'{"student":"n","course":"n"}',
                            seed=len(store.settings.stream))
        self._after: dict[int, int] = {}

    async def fill(self, size: int, slice_size: int = 1000) -> None:
        js = self.store.nc.jetstream(publish_async_max_pending=4000)
        slices = size // slice_size
        for s in range(slices):
            due = (s + 1) * 100 // slices - s * 100 // slices  # 100 of each target, spread evenly
            for _ in range(due):
                await asyncio.gather(*(self._target(s, t) for t in range(self.targets)))
            count = max(0, slice_size - 4 * self.targets * due)  # a DCB append stores 3 messages here
            futures = [await js.publish_async(subject, body, headers=headers)
                       for subject, body, headers in self._noise.commits(count)]
            await asyncio.gather(*futures)
            if s % 100 == 0:
                progress(f"{self.store.settings.stream}: {(s + 1) * slice_size:,}/{size:,}")

    async def _target(self, s: int, t: int) -> None:
        """One event of DCB target ``t``, appended as a decision would (under a condition on its course tag, so
        the tag's index has back pointers), and one commit of entity target ``t``."""
        course = f"course:hot{t}"
        condition = AppendCondition(Query.of(types=["Enrolled"], tags=[course, f"term:{t % 2}"]), self._after.get(t, 0))
        event = TaggedEvent(Enrolled(student=f"s{s}", course=f"hot{t}"), {course, f"term:{t % 2}"})
        self._after[t] = (await self.store.dcb.append([event], condition=condition)).position
        await self.store.append(StreamId("Course", f"hot{t}"), [Enrolled(student=f"s{s}", course=f"hot{t}")])

    async def dcb_reads(self) -> list[float]:
        samples = []
        for t in range(self.targets):
            started = time.perf_counter()
            found = await self.store.dcb.read(Query.of(types=["Enrolled"], tags=[f"course:hot{t}", f"term:{t % 2}"]))
            samples.append((time.perf_counter() - started) * 1000)
            assert len(found.events) == 100, len(found.events)
        return samples

    async def entity_loads(self) -> list[float]:
        samples = []
        for t in range(self.targets):
            started = time.perf_counter()
            events = await self.store.read(StreamId("Course", f"hot{t}"))
            samples.append((time.perf_counter() - started) * 1000)
            assert len(events) == 100, len(events)
        return samples


async def reads(url: str, quick: bool, result: dict[str, Any]) -> None:
    big = 100_000 if quick else 1_000_000
    sizes = {"20000": 20_000, str(big): big}
    targets = 10
    async with contextlib.AsyncExitStack() as stack:
        streams = {}
        for key, size in sizes.items():
            store = await connect(url, f"read{key}")
            stack.push_async_callback(store.close)
            streams[key] = ReadStream(store, targets)
            await streams[key].fill(size)
        dcb: dict[str, list[float]] = {k: [] for k in sizes}
        entity: dict[str, list[float]] = {k: [] for k in sizes}
        ratios: dict[str, list[float]] = {k: [] for k in sizes}
        for r in range(ROUNDS):
            for key, stream in streams.items():
                d, e = p50(await stream.dcb_reads()), p50(await stream.entity_loads())
                dcb[key].append(d)
                entity[key].append(e)
                ratios[key].append(d / e)
            progress(f"read round {r}: dcb {[round(v[-1], 2) for v in dcb.values()]} ms, "
                     f"entity {[round(v[-1], 2) for v in entity.values()]} ms")
        result["dcb_read_p50_ms"] = {k: round(p50(v), 3) for k, v in dcb.items()}
        result["entity_load_p50_ms"] = {k: round(p50(v), 3) for k, v in entity.items()}
        result["dcb_read_over_entity_load"] = {k: round(p50(v), 3) for k, v in ratios.items()}
        result["dcb_read_growth"] = round(result["dcb_read_p50_ms"][str(big)] / result["dcb_read_p50_ms"]["20000"], 3)


async def main(quick: bool) -> dict[str, Any]:
    result: dict[str, Any] = {}
    appends: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dcb-") as tmp, EmbeddedServer(tmp) as server:
        appends["replicas_1"] = await append_rates(server.url, 1, quick)
        await storage(server.url, result)
        await reads(server.url, quick, result)
    cluster = EmbeddedCluster(3)
    cluster.start()
    try:
        appends["replicas_3"] = await append_rates(cluster.url, 3, quick)
    finally:
        cluster.close()
    result["appends"] = appends
    result["dcb_append_over_entity_append"] = {k: v["dcb_append_over_entity_append"] for k, v in appends.items()}
    result["raw_batch3_over_raw_single"] = {k: v["raw_batch3_over_raw_single"] for k, v in appends.items()}
    result["targets"] = {
        "dcb_append_over_entity_append >= 0.5": {k: v >= 0.5 for k, v in result["dcb_append_over_entity_append"].items()},
        "dcb_read_over_entity_load <= 2": max(result["dcb_read_over_entity_load"].values()) <= 2,
    }
    result["setup"] = {"writers": WRITERS, "rounds": ROUNDS, "quick": quick}
    return result


if __name__ == "__main__":
    run(main, __doc__)

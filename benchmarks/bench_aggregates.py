"""Benchmark of aggregates: load latency with and without snapshots, and command throughput.

Run with the project's venv: ``.venv/bin/python benchmarks/bench_aggregates.py [--quick]``.
Starts its own nats-server in a temporary directory; prints progress to stderr
and one JSON object as the last line of stdout.

Layout: aggregates of 10, 1,000 and 10,000 events (one event per commit) are
interleaved at random with 200,000 events of 20,000 other entities in one
stream. Then:

* ``load_p50_ms`` / ``load_p99_ms``: ``Repository.get`` without cache or snapshots.
* ``load_snap_p50_ms`` / ``load_snap_p99_ms``: the same with ``snapshot_every=100``
  (each aggregate loaded once beforehand, which writes its snapshot).
* ``load_recent10_p50_ms`` / ``load_recent10_p99_ms``: 10-event aggregates whose
  events sit next to each other at the end of the stream (the spread-out ones
  above make nats-server scan many blocks).
* ``command_eps``: ``Repository.execute`` (load + command + save) across 1,000
  aggregates with 64 concurrent tasks, default repository (cache on);
  ``command_eps_uncached`` the same with ``cache_size=0`` (a full load each time: these
  aggregates hold 16 to 46 commits over the rounds, so a load fetches that many);
  ``command_eps_uncached_snap`` the same with ``snapshot_every=10`` too (a load
  reads the snapshot and the commits after it);
  ``command_eps_uncached_raw`` the uncached command in plain nats-py, the floor of
  any client's: the aggregate's commits fetched by sequence (all pipelined,
  positions known in advance, nothing decoded), then one append with the expected
  last subject sequence. The four are measured in 3 interleaved rounds (medians
  reported; ``command_rounds`` has every round), with the nats-server's and this
  process's CPU per command read from ``/proc`` (``server_us_per_command``,
  ``client_us_per_command``): the server's CPU per uncached command bounds
  uncached commands even for a client that cost nothing
  (``targets.uncached_server_ceiling_over_command_eps``).
* ``raw_append_concurrent_eps``: single-event commits with the event store's wire
  headers, published with nats-py ``js.publish_async`` and pipelined.

Cold loads, in two streams of their own (``COLD20000`` and ``COLD1000000``;
100,000 with ``--quick``), each filled in slices of 1,000 wire-format messages
of 20,000 other entities, with commits appended through the event store
between the slices:

* ``cold_load_p50_ms`` / ``cold_load_p99_ms``, keyed by the stream's size:
  ``Repository.get`` (no cache, no snapshots) of 100 aggregates of 10 commits
  each spread evenly through the stream. The streams are measured in 5
  interleaved rounds; p50 is the median of the rounds' p50s, p99 over all
  loads. ``cold_load_old20k_*``: aggregates of the big stream whose 10 commits
  lie in its first 20,000 messages (old, not written since).
* ``cold_load_raw_p50_ms``: the same commits fetched with plain nats-py
  (``js.get_msg(direct=True)`` by sequence, all ten pipelined, positions known
  in advance), in the same rounds: the floor of any load.
* ``load_scan_vs_chain``: ms (median of 5 interleaved rounds) to fetch the
  commits of entities of 10, 100 and 1,000 commits spread through the big
  stream: by a ``next_by_subj`` scan, by walking the back pointers, and as
  ``read`` chooses (``auto``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import nats.js.errors

from pydantic import BaseModel

from aggregates import Aggregate, DomainEvent, Repository, applies
from eventstore import EmbeddedServer, EventStore, EventStoreSettings, StreamId
from eventstore.wire import Header
from harness import Noise, progress, run, wire_commit  # this script's folder is on sys.path
from proc_cpu import cpu_seconds


class Deposited(DomainEvent):
    amount: int


class AccountState(BaseModel):
    balance: int = 0


class Account(Aggregate[AccountState]):
    def deposit(self, amount: int) -> None:
        self.record(Deposited(amount=amount))

    @applies(Deposited)
    def _deposited(self, event: Deposited) -> None:
        self.state.balance += event.amount


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


async def publish_pipelined(store: EventStore, messages: Any, total: int, label: str) -> float:
    """Publish (subject, body, headers) tuples with js.publish_async; returns events per second."""
    js = store.nc.jetstream(publish_async_max_pending=4000)
    started = time.perf_counter()
    futures: list[asyncio.Future[Any]] = []
    for i, (subject, body, headers) in enumerate(messages, start=1):
        futures.append(await js.publish_async(subject, body, headers=headers))
        if len(futures) >= 5000:
            await asyncio.gather(*futures)
            futures.clear()
        if i % 50_000 == 0:
            progress(f"{label}: {i:,}/{total:,}")
    await asyncio.gather(*futures)
    return total / (time.perf_counter() - started)


async def fill(store: EventStore, sizes: dict[str, int], noise_entities: int, noise_each: int, seed: int) -> dict[str, list[str]]:
    """Write the aggregates' events interleaved at random with the noise; returns aggregate ids by size."""
    prefix = store.settings.subject_prefix
    rng = random.Random(seed)
    ids: dict[str, list[str]] = {}
    entities: list[tuple[str, int]] = []
    for size, count in sizes.items():
        ids[size] = [f"s{size}-{i}" for i in range(count)]
        entities += [(StreamId("Account", a).subject(prefix), int(size)) for a in ids[size]]
    entities += [(StreamId("Noise", f"n{i}").subject(prefix), noise_each) for i in range(noise_entities)]
    slots = [index for index, (_, n) in enumerate(entities) for _ in range(n)]
    rng.shuffle(slots)
    versions = [0] * len(entities)
    body = Deposited(amount=1).model_dump_json().encode()

    def messages() -> Any:
        for index in slots:
            versions[index] += 1
            yield wire_commit(entities[index][0], "Deposited", versions[index], body)

    eps = await publish_pipelined(store, messages(), len(slots), "fill")
    progress(f"filled {len(slots):,} events at {eps:,.0f}/s")
    return ids


async def time_loads(get: Callable[[str], Awaitable[Account]], ids: list[str], loads: int, size: int) -> list[float]:
    samples = []
    for i in range(loads):
        started = time.perf_counter()
        account = await get(ids[i % len(ids)])
        samples.append((time.perf_counter() - started) * 1000)
        assert account.version == size and account.state.balance == size, account
    return samples


async def run_commands(
    repo: Repository[Account], ids: list[str], commands: int, concurrency: int, create: bool = False
) -> float:
    counter = iter(range(commands))

    async def worker() -> None:
        for i in counter:
            await repo.execute(ids[i % len(ids)], lambda a: a.deposit(1), create=create, exist_ok=create)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return commands / (time.perf_counter() - started)


async def raw_uncached_commands(store: EventStore, ids: list[str], commands: int, concurrency: int) -> float:
    """Uncached commands in plain nats-py (see the module docs); returns commands per second."""
    js = store.nc.jetstream()
    stream, prefix = store.settings.stream, store.settings.subject_prefix
    known = {a: [e.position for e in await store.read(StreamId("Account", a))] for a in ids}  # not timed
    counter = iter(range(commands))

    async def worker() -> None:
        for i in counter:
            aggregate_id = ids[i % len(ids)]
            subject = StreamId("Account", aggregate_id).subject(prefix)
            while True:
                positions = known[aggregate_id]
                msgs = await asyncio.gather(*(js.get_msg(stream, seq=p, direct=True) for p in positions))
                _, body, headers = wire_commit(subject, "Deposited", len(msgs) + 1, b'{"amount":1}')
                headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(positions[-1])
                try:
                    ack = await js.publish(subject, body, headers=headers)
                except nats.js.errors.APIError:  # a conflict: another worker wrote it first
                    known[aggregate_id] = [e.position for e in await store.read(StreamId("Account", aggregate_id))]
                    continue
                known[aggregate_id] = [*positions, ack.seq]
                break

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return commands / (time.perf_counter() - started)


async def command_rounds(
    store: EventStore, server_pid: int, ids: list[str], runs: dict[str, tuple[Repository[Account] | None, int]]
) -> dict[str, Any]:
    """Each run (a repository, or None for the raw nats-py one, and its number of commands) in 3 interleaved
    rounds: the median commands per second of each, every round, and the median CPU per command of both
    processes."""
    rounds: dict[str, list[float]] = {name: [] for name in runs}
    server_us: dict[str, list[float]] = {name: [] for name in runs}
    client_us: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(3):
        for name, (repo, count) in runs.items():
            if repo is not None and repo.cache_size > 0:
                # The other runs wrote to these aggregates since: one untimed command each brings the cache up to
                # date, or the round would time a conflict and a reload per aggregate.
                await run_commands(repo, ids, len(ids), 64)
            server0, client0 = cpu_seconds(server_pid), time.process_time()
            if repo is None:
                eps = await raw_uncached_commands(store, ids, count, 64)
            else:
                eps = await run_commands(repo, ids, count, 64)
            rounds[name].append(round(eps))
            server_us[name].append((cpu_seconds(server_pid) - server0) / count * 1e6)
            client_us[name].append((time.process_time() - client0) / count * 1e6)
            progress(f"round {r + 1}, {name}: {eps:,.0f}/s")
    result: dict[str, Any] = {name: round(statistics.median(eps)) for name, eps in rounds.items()}
    result["command_rounds"] = rounds
    result["server_us_per_command"] = {name: round(statistics.median(us)) for name, us in server_us.items()}
    result["client_us_per_command"] = {name: round(statistics.median(us)) for name, us in client_us.items()}
    return result


class ColdStream:
    """A stream of its own, filled in slices of wire-format messages of 20,000 other entities, with commits
    appended through the event store between the slices (spread evenly through the stream)."""

    def __init__(self, store: EventStore, seed: int) -> None:
        self.store = store
        self.repo = Repository(store, Account, cache_size=0)
        self.positions: dict[str, list[int]] = {}
        self.size = 0
        self._noise = Noise(store.settings.subject_prefix, "Deposited", Deposited(amount=1).model_dump_json().encode(),
                            seed)

    async def _deposit(self, aggregate_ids: list[str]) -> None:
        async def one(aggregate_id: str) -> None:
            result = await self.store.append(StreamId("Account", aggregate_id), [Deposited(amount=1)])
            self.positions.setdefault(aggregate_id, []).append(result.position)

        await asyncio.gather(*(one(a) for a in aggregate_ids))

    async def grow_to(self, size: int, spread: dict[str, int], slice_size: int = 1000) -> None:
        """Fill up to about ``size`` messages; ``spread``: aggregate ids -> commits, appended evenly between slices."""
        slices = max(*spread.values(), (size - self.size) // slice_size)
        per_slice = (size - self.size) // slices
        for s in range(slices):
            due = [a for a, n in spread.items() if s % (slices // n) == 0 and len(self.positions.get(a, [])) < n]
            await self._deposit(due)
            count = max(0, per_slice - len(due))
            await publish_pipelined(self.store, self._noise.commits(count), count, "cold fill")
            if s % 100 == 0:
                progress(f"{self.store.settings.stream}: {self.size + (s + 1) * per_slice:,} messages")
        self.size = (await self.store.info()).last_position

    async def loads(self, aggregate_ids: list[str], count: int) -> list[float]:
        samples = []
        for i in range(count):
            started = time.perf_counter()
            account = await self.repo.get(aggregate_ids[i % len(aggregate_ids)])
            samples.append((time.perf_counter() - started) * 1000)
            assert account.version == 10, account
        return samples

    async def raw_loads(self, aggregate_ids: list[str], count: int) -> list[float]:
        """The same commits with plain nats-py: direct gets by sequence, all ten pipelined, positions known."""
        js = self.store.nc.jetstream()
        stream = self.store.settings.stream
        samples = []
        for i in range(count):
            started = time.perf_counter()
            msgs = await asyncio.gather(
                *(js.get_msg(stream, seq=p, direct=True) for p in self.positions[aggregate_ids[i % len(aggregate_ids)]])
            )
            samples.append((time.perf_counter() - started) * 1000)
            assert len(msgs) == 10
        return samples


async def cold_loads(server_url: str, quick: bool, result: dict[str, Any]) -> None:
    """The cold-load figures (see the module docs): two streams, measured in interleaved rounds."""
    big = 100_000 if quick else 1_000_000
    rounds, per_round = 5, 20 if quick else 60
    streams: dict[int, ColdStream] = {}
    group = [f"cold-{i}" for i in range(100)]
    old = [f"old-{i}" for i in range(100)]
    longs = {f"long{n}": n for n in (10, 100, 1000)}
    async with contextlib.AsyncExitStack() as stack:
        for size in (20_000, big):
            settings = EventStoreSettings(nats_url=server_url, stream=f"COLD{size}", subject_prefix=f"cold{size}")
            streams[size] = ColdStream(await stack.enter_async_context(EventStore.connect(settings)), seed=size)
        await streams[20_000].grow_to(20_000, dict.fromkeys(group, 10))
        await streams[big].grow_to(20_000, dict.fromkeys(old, 10))  # old entities, not written since
        await streams[big].grow_to(big, {**dict.fromkeys(group, 10), **longs})
        progress(f"cold streams: {streams[20_000].size:,} and {streams[big].size:,} messages")

        cases = {"20000": (streams[20_000], group), str(big): (streams[big], group), "old20k": (streams[big], old)}
        round_p50: dict[str, list[float]] = {k: [] for k in cases}
        raw_p50: dict[str, list[float]] = {k: [] for k in cases}
        every: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(rounds):  # interleaved: each round loads from every stream, so noise hits all alike
            for key, (stream, ids) in cases.items():
                samples = await stream.loads(ids, per_round)
                every[key] += samples
                round_p50[key].append(percentile(samples, 50))
                raw_p50[key].append(percentile(await stream.raw_loads(ids, per_round), 50))
        result["cold_load_p50_ms"] = {k: round(statistics.median(round_p50[k]), 3) for k in ("20000", str(big))}
        result["cold_load_p99_ms"] = {k: round(percentile(every[k], 99), 3) for k in ("20000", str(big))}
        result["cold_load_raw_p50_ms"] = {k: round(statistics.median(raw_p50[k]), 3) for k in ("20000", str(big))}
        result["cold_load_old20k_p50_ms"] = round(statistics.median(round_p50["old20k"]), 3)
        result["cold_load_old20k_p99_ms"] = round(percentile(every["old20k"], 99), 3)
        progress(f"cold loads p50 {result['cold_load_p50_ms']}, p99 {result['cold_load_p99_ms']}, "
                 f"raw p50 {result['cold_load_raw_p50_ms']}, old p50 {result['cold_load_old20k_p50_ms']}")

        hows: tuple[Literal["scan", "chain", "auto"], ...] = ("scan", "chain", "auto")
        result["load_scan_vs_chain"] = {}
        for name, n in longs.items():
            times: dict[str, list[float]] = {how: [] for how in hows}
            for _ in range(5):
                for how in hows:
                    started = time.perf_counter()
                    commits = await streams[big].store._appender.entities.commits(StreamId("Account", name), how=how)
                    times[how].append((time.perf_counter() - started) * 1000)
                    assert len(commits) == n, (how, len(commits))
            figures = {f"{how}_ms": round(statistics.median(t), 3) for how, t in times.items()}
            result["load_scan_vs_chain"][str(n)] = figures
            progress(f"{n} commits spread through {streams[big].size:,}: {figures}")


async def main(quick: bool) -> dict[str, Any]:
    sizes = {"10": 100, "1000": 10, "10000": 3}
    loads = {"10": 300, "1000": 60, "10000": 15}
    noise_entities, noise_each = 20_000, 10
    raw_count, warm_commands, commands, uncached_commands, raw_commands = 30_000, 14_000, 4_000, 2_000, 1_000
    if quick:
        noise_entities, raw_count, warm_commands, commands, uncached_commands, raw_commands = 2_000, 10_000, 2_000, 2_000, 1_000, 500
        loads = {"10": 100, "1000": 20, "10000": 5}
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-aggregates-") as tmp, EmbeddedServer(tmp) as server:
        await cold_loads(server.url, quick, result)
        settings = EventStoreSettings(nats_url=server.url, stream="BENCH", subject_prefix="bench")
        async with EventStore.connect(settings) as store:
            plain = Repository(store, Account, cache_size=0)
            ids = await fill(store, sizes, noise_entities, noise_each, seed=7)

            snapped = Repository(store, Account, cache_size=0, snapshot_every=100)
            for name, repo in (("load", plain), ("load_snap", snapped)):
                result[f"{name}_p50_ms"], result[f"{name}_p99_ms"] = {}, {}
                for size, count in loads.items():
                    if repo is snapped:
                        for aggregate_id in ids[size]:
                            await repo.get(aggregate_id)  # writes the snapshot (aggregates of >= 100 events)
                    samples = await time_loads(repo.get, ids[size], count, int(size))
                    result[f"{name}_p50_ms"][size] = round(percentile(samples, 50), 3)
                    result[f"{name}_p99_ms"][size] = round(percentile(samples, 99), 3)
                    progress(f"{name} {size:>5} events: p50 {percentile(samples, 50):.2f} ms, p99 {percentile(samples, 99):.2f} ms")

            # The same 10-event loads for aggregates written back to back (the best case for a plain load).
            recent = [f"recent-{i}" for i in range(100)]
            await run_commands(Repository(store, Account), recent, len(recent) * 10, 64, create=True)
            samples = await time_loads(plain.get, recent, loads["10"], 10)
            result["load_recent10_p50_ms"] = round(percentile(samples, 50), 3)
            result["load_recent10_p99_ms"] = round(percentile(samples, 99), 3)
            progress(f"load of 10 adjacent events: p50 {percentile(samples, 50):.2f} ms, p99 {percentile(samples, 99):.2f} ms")

            command_ids = [f"c{i}" for i in range(1000)]
            cached = Repository(store, Account)
            await run_commands(cached, command_ids, len(command_ids), 64, create=True)
            # Measured right before the commands, so both see the same stream and server state.
            raw = (wire_commit(f"bench.Raw.r{i}", "Deposited", 1, b'{"amount":1}') for i in range(raw_count))
            result["raw_append_concurrent_eps"] = round(await publish_pipelined(store, raw, raw_count, "raw"))
            progress(f"raw publish_async: {result['raw_append_concurrent_eps']:,}/s")
            snapped_commands = Repository(store, Account, cache_size=0, snapshot_every=10)
            await run_commands(cached, command_ids, warm_commands, 64)
            await run_commands(snapped_commands, command_ids, len(command_ids), 64)  # writes the snapshots
            assert server.pid is not None
            result.update(await command_rounds(store, server.pid, command_ids, {
                "command_eps": (cached, commands),
                "command_eps_uncached": (plain, uncached_commands),
                "command_eps_uncached_raw": (None, raw_commands),
                "command_eps_uncached_snap": (snapped_commands, uncached_commands),
            }))
            check = await plain.get("c0")
            runs = [warm_commands, len(command_ids)] + 3 * [len(command_ids), commands, uncached_commands, raw_commands, uncached_commands]
            assert check.version == 1 + sum(math.ceil(n / len(command_ids)) for n in runs), check  # c0 is in every run
    result["targets"] = {
        "load_snap_p99_10000_over_load_p99_10": round(result["load_snap_p99_ms"]["10000"] / result["load_p99_ms"]["10"], 3),
        "load_snap_p99_10000_over_load_recent10_p99": round(
            result["load_snap_p99_ms"]["10000"] / result["load_recent10_p99_ms"], 3
        ),
        "command_eps_over_raw": round(result["command_eps"] / result["raw_append_concurrent_eps"], 3),
        "command_eps_uncached_over_command_eps": round(result["command_eps_uncached"] / result["command_eps"], 3),
        "command_eps_uncached_snap_over_command_eps": round(result["command_eps_uncached_snap"] / result["command_eps"], 3),
        "command_eps_uncached_over_raw": round(result["command_eps_uncached"] / result["command_eps_uncached_raw"], 3),
        "uncached_server_ceiling_over_command_eps": round(
            1e6 / result["server_us_per_command"]["command_eps_uncached"] / result["command_eps"], 3
        ),
        "cold_load_p50_largest_over_20000": round(
            result["cold_load_p50_ms"][max(result["cold_load_p50_ms"], key=int)] / result["cold_load_p50_ms"]["20000"], 3
        ),
        "cold_load_p50_over_raw": {
            k: round(v / result["cold_load_raw_p50_ms"][k], 3) for k, v in result["cold_load_p50_ms"].items()
        },
    }
    result["setup"] = {
        "aggregates": sizes,
        "noise_events": noise_entities * noise_each,
        "loads": loads,
        "snapshot_every": 100,
        "command_rounds": 3,
        "commands_per_round": commands,
        "uncached_commands_per_round": uncached_commands,
        "raw_uncached_commands_per_round": raw_commands,
        "concurrency": 64,
        "command_aggregates": 1000,
    }
    return result


if __name__ == "__main__":
    run(main, __doc__)

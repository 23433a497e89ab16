"""Benchmark of the one replay (issue #12): read_all and a projection rebuild against a raw nats-py pull replay.

Starts its own nats-server, writes ``--events`` single-event commits in the
event store's wire format, then runs ``--rounds`` interleaved rounds of:

* ``raw``: nats-py, one ``$JS.API.CONSUMER.MSG.NEXT`` pull for the whole stream
  answered into a plain subscription callback that counts messages (nats-py
  builds a ``Msg`` with parsed headers for each);
* ``read_all``: :meth:`EventStore.read_all`, every event decoded into a
  ``RecordedEvent`` (payload decoding is lazy and not asked for);
* ``rebuild``: :func:`projections.rebuild` of a balance projection into a
  fresh SQLite file (decode each event's payload, get the row, upsert it).

Reports each one's median events/s and the median of the per-round ratios
(``read_all_over_raw``, target >= 1.5; ``rebuild_over_raw``, target >= 0.8),
and the client CPU per event of read_all. Progress goes to stderr; the last
line of stdout is one JSON object.
Run: ``.venv/bin/python benchmarks/bench_replay.py [--events N] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from bench_projections import Balances, populate, raw_pull_replay, say  # noqa: E402

from eventstore import EmbeddedServer, EventStore, EventStoreSettings  # noqa: E402
from projections import ProjectionSettings, rebuild  # noqa: E402


async def read_all(store: EventStore, count: int) -> tuple[float, float]:
    """(events/s, client CPU µs per event) of one full read_all."""
    cpu, started = time.process_time(), time.perf_counter()
    seen = 0
    async for batch in store.read_all():
        seen += len(batch)
    assert seen == count, seen
    return count / (time.perf_counter() - started), (time.process_time() - cpu) / count * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {"raw": [], "read_all": [], "rebuild": [], "read_all_cpu_us": []}
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp, EmbeddedServer(Path(tmp) / "nats") as server:
        es_settings = EventStoreSettings(nats_url=server.url, stream="BENCH", subject_prefix="bench")
        store = await EventStore.connect(es_settings)
        try:
            await populate(store, args.events)
            for n in range(args.rounds):
                raw = await raw_pull_replay(store, args.events)
                ours, cpu_us = await read_all(store, args.events)
                settings = ProjectionSettings(eventstore=es_settings, database=Path(tmp) / f"rm{n}.sqlite3")
                result = await rebuild(Balances(), settings, event_store=store)
                rebuilt = result.events / result.seconds
                for key, value in (("raw", raw), ("read_all", ours), ("rebuild", rebuilt), ("read_all_cpu_us", cpu_us)):
                    rows[key].append(value)
                say(f"round {n + 1}: raw {raw:,.0f}, read_all {ours:,.0f} ({ours / raw:.2f}x, {cpu_us:.2f} µs CPU/event), "
                    f"rebuild {rebuilt:,.0f} ({rebuilt / raw:.2f}x) events/s")
        finally:
            await store.close()
    median = statistics.median
    out = {
        "bench": "replay",
        "events": args.events,
        "rounds": args.rounds,
        "raw_pull_eps": round(median(rows["raw"])),
        "read_all_eps": round(median(rows["read_all"])),
        "rebuild_eps": round(median(rows["rebuild"])),
        "read_all_cpu_us_per_event": round(median(rows["read_all_cpu_us"]), 2),
        "read_all_over_raw": round(median(a / r for a, r in zip(rows["read_all"], rows["raw"])), 3),
        "rebuild_over_raw": round(median(b / r for b, r in zip(rows["rebuild"], rows["raw"])), 3),
    }
    out["targets_met"] = {"read_all_ge_1.5": out["read_all_over_raw"] >= 1.5, "rebuild_ge_0.8": out["rebuild_over_raw"] >= 0.8}
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())

"""Simulation of the command routing's assignment (aggregates.routing) at a scale one machine cannot run.

Run with the project's venv: ``.venv/bin/python benchmarks/sim_routing.py``. No server: it computes
the assignment of 10,000 partitions to 100 workers (and of the defaults, 64 partitions to 4
workers), then what a join and a leave move. Prints one JSON object as its last line:

* ``assign_ms``: the time to compute one assignment (every worker does it on a membership change);
* ``max_over_mean``: the busiest worker's partitions over the mean (1.0 is perfectly even);
* ``moved_on_join`` / ``moved_on_leave``: the fraction of partitions that change owner, against
  the least any scheme can move (``ideal``: the joiner's or the leaver's share);
* ``moved_between_others_on_join`` / ``..._on_leave``: the fraction that moved between two workers that
  were there before and after (the bounded loads' cost: a full worker's overflow walks on).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aggregates.routing import assign  # noqa: E402


def owner_map(assignment: dict[str, frozenset[int]]) -> dict[int, str]:
    return {p: name for name, parts in assignment.items() for p in parts}


def scenario(workers: int, partitions: int, trials: int = 5) -> dict[str, object]:
    names = [f"host{i}:{1000 + i}:{i:08x}" for i in range(workers)]
    times, ratios, joins, leaves = [], [], [], []
    others_join, others_leave = [], []
    for trial in range(trials):
        members = [f"{name}-{trial}" for name in names]
        started = time.perf_counter()
        before = assign(members, partitions)
        times.append((time.perf_counter() - started) * 1000)
        sizes = [len(parts) for parts in before.values()]
        ratios.append(max(sizes) / statistics.mean(sizes))
        owners = owner_map(before)
        joined = owner_map(assign([*members, f"new-{trial}"], partitions))
        moved = [p for p in owners if owners[p] != joined[p]]
        joins.append(len(moved) / partitions)
        others_join.append(sum(joined[p] != f"new-{trial}" for p in moved) / partitions)
        leaver = members[trial % workers]
        left = owner_map(assign([m for m in members if m != leaver], partitions))
        moved = [p for p in owners if owners[p] != left[p]]
        leaves.append(len(moved) / partitions)
        others_leave.append(sum(owners[p] != leaver for p in moved) / partitions)
    return {
        "workers": workers, "partitions": partitions,
        "assign_ms": round(statistics.median(times), 1),
        "max_over_mean": round(statistics.median(ratios), 3),
        "moved_on_join": round(statistics.median(joins), 4), "ideal_join": round(1 / (workers + 1), 4),
        "moved_on_leave": round(statistics.median(leaves), 4), "ideal_leave": round(1 / workers, 4),
        "moved_between_others_on_join": round(statistics.median(others_join), 4),
        "moved_between_others_on_leave": round(statistics.median(others_leave), 4),
    }


if __name__ == "__main__":
    results = [scenario(100, 10_000), scenario(4, 64), scenario(10, 256)]
    for result in results:
        print(f"[sim_routing] {result}", file=sys.stderr)
    print(json.dumps({"scenarios": results}))

"""Which worker serves which aggregate: partitions of the id space, assigned to workers on a hash ring.

A command service's workers share the commands of an aggregate category. With routing, the
commands of one aggregate reach one worker while it lives, so that worker's aggregate cache stays
current: a command costs one append instead of a load, or a conflict and a reload.

* **Partitions.** An aggregate id belongs to partition ``crc32(utf-8 id) % partitions`` (CRC-32 as
  in zlib, gzip and PNG: one line in any language). The client sends a command for it on
  ``<prefix>.<Category>.<Command>.<partition>``.
* **Assignment.** Each worker that serves a category places :data:`VIRTUAL_NODES` points on a ring
  of 64-bit hashes; a partition belongs to the worker owning the first point at or after the
  partition's own hash (consistent hashing). Every worker computes the same assignment from the
  same member list, so there is no coordinator. No worker holds more than :data:`LOAD_BOUND` times
  the mean (a full worker's overflow goes on to the next point). When a worker joins, about
  ``1/(workers+1)`` of the partitions move to it; when one leaves or dies, its own partitions move,
  plus a few that the bound pushes on between the others.
* **Nothing rests on it.** Routing only decides where a command is *likely* to find a warm cache.
  Every command still runs under optimistic concurrency and its command id, so two workers that
  briefly both serve a partition (during a move) stay correct; a partition nobody serves for a
  moment is answered by the unpartitioned subject every worker also serves.

At 100 workers and 10,000 partitions (``benchmarks/sim_routing.py``) one assignment takes about
0.15-0.2 s to compute (0.7 ms at the default 64 partitions and 4 workers), the busiest worker holds
1.15× the mean (1.44× without the bound), and a join moves 1.2% of the partitions, a leave 1.4%
(the least possible is 1%: the joiner's or the leaver's share).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import zlib
from collections.abc import Iterable

from eventstore import InvalidArgumentError

__all__ = [
    "DEFAULT_PARTITIONS", "LOAD_BOUND", "MAX_PARTITIONS", "VIRTUAL_NODES", "assign", "check_partitions", "partition_of",
]

DEFAULT_PARTITIONS = 64
"""Partitions per category by default: enough for 64 workers to each own some, few subscriptions per worker."""

MAX_PARTITIONS = 65_536

VIRTUAL_NODES = 128
"""Points each worker places on the ring: more points, more even shares before the bound below."""

LOAD_BOUND = 1.15
"""No worker holds more than this times the mean share (rounded up): the busiest is not a bottleneck."""


def check_partitions(partitions: object) -> int:
    """``partitions`` if it is an int from 1 to :data:`MAX_PARTITIONS`; else :class:`~eventstore.InvalidArgumentError`."""
    if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= MAX_PARTITIONS:
        raise InvalidArgumentError(
            f"partitions must be an int from 1 to {MAX_PARTITIONS:,}, not {partitions!r:.80}; every service and "
            f"client of one subject prefix uses the same number (default {DEFAULT_PARTITIONS})."
        )
    return partitions


def partition_of(aggregate_id: str, partitions: int) -> int:
    """The partition (``0 <= p < partitions``) of an aggregate id: ``crc32(utf-8 id) % partitions``."""
    return zlib.crc32(aggregate_id.encode()) % partitions


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def assign(members: Iterable[str], partitions: int) -> dict[str, frozenset[int]]:
    """Each member's partitions (every member gets an entry; each partition goes to exactly one member).

    Deterministic in the set of members, whatever their order: every worker that sees the same
    members computes the same assignment. A member holds at most :data:`LOAD_BOUND` times the mean
    (consistent hashing with bounded loads): a partition whose first point belongs to a full member
    goes on to the next point's member.
    """
    names = sorted(set(members))
    if not names:
        return {}
    ring = sorted((_point(f"{name}#{v}"), name) for name in names for v in range(VIRTUAL_NODES))
    points = [point for point, _ in ring]
    capacity = math.ceil(LOAD_BOUND * partitions / len(names))
    owned: dict[str, set[int]] = {name: set() for name in names}
    # In the partitions' hash order, so that the order (and with it who is full first) is the same everywhere.
    for key, partition in sorted((_point(f"partition#{p}"), p) for p in range(partitions)):
        at = bisect.bisect_left(points, key)
        while len(owned[name := ring[at % len(ring)][1]]) >= capacity:
            at += 1
        owned[name].add(partition)
    return {name: frozenset(parts) for name, parts in owned.items()}

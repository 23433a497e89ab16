"""The CPU time a process has used, from ``/proc``: the benchmarks' one reader of it."""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU of ``pid`` (plus its reaped children's), from ``/proc``; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / _TICK


def context_switches(pid: int) -> int:
    """How many times ``pid``'s main thread was switched out (voluntary and not), from ``/proc``; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
    except OSError:
        return 0

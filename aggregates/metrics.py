"""The command service's metrics, in Prometheus' default registry (served by ``jetsourcing ... --metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

__all__ = ["AGGREGATE_CACHE", "COMMANDS", "COMMAND_SECONDS"]

COMMANDS = Counter(
    "jetsourcing_commands", "Commands a command service answered, by subject and outcome (ok, duplicate, domain, "
    "not_found, exists, invalid, conflict, unavailable, failed, cancelled).", ["subject", "outcome"],
)
COMMAND_SECONDS = Histogram(
    "jetsourcing_command_seconds", "Time from a command's arrival at the service to its reply.", ["subject"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
AGGREGATE_CACHE = Counter(
    "jetsourcing_aggregate_cache", "How commands found their aggregate in the repository's cache, by category: hit "
    "(current), stale (another process wrote it since), miss (not cached).", ["category", "outcome"],
)

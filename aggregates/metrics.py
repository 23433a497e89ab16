"""The command service's metrics, in Prometheus' default registry (served by ``jetsourcing ... --metrics-port``)."""

from __future__ import annotations

from typing import Any, TypeVar

from prometheus_client import Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase

__all__ = ["AGGREGATE_CACHE", "COMMANDS", "COMMAND_SECONDS", "labelled"]

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

M = TypeVar("M", bound=MetricWrapperBase)
_children: dict[tuple[Any, ...], Any] = {}  # (metric, *labels) -> the labelled child


def labelled(metric: M, *labels: str) -> M:
    """``metric.labels(*labels)``, looked up once: a command would otherwise pay prometheus_client's locked lookup
    for every sample. The label values come from small fixed sets (served subjects, outcomes, categories)."""
    key = (metric, *labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*labels)
    return child

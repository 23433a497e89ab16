"""Metrics of projections and reactors in Prometheus' default registry, and the endpoint that serves them.

``jetsourcing ... --metrics-port N [--metrics-addr ADDR]`` calls :func:`serve_metrics`; every
metric of the process (the command service's too) is then at ``http://ADDR:N/metrics`` (ADDR
127.0.0.1 unless given: the endpoint has no authentication).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, start_http_server

from eventstore import InvalidArgumentError

__all__ = [
    "PROJECTION_CHECKPOINT", "PROJECTION_EVENTS", "PROJECTION_LAG", "REACTOR_DEAD_LETTERS", "REACTOR_DELIVERIES",
    "REACTOR_REDELIVERIES", "serve_metrics", "serving",
]

PROJECTION_EVENTS = Counter("jetsourcing_projection_events", "Events applied by a projection's handlers.", ["projection"])
PROJECTION_CHECKPOINT = Gauge("jetsourcing_projection_checkpoint", "The stream position a projection's read model "
                              "has reached.", ["projection"])
PROJECTION_LAG = Gauge("jetsourcing_projection_lag_positions", "Stream positions between the stream's last message "
                       "and a projection's checkpoint (updated every status interval).", ["projection"])
REACTOR_DELIVERIES = Counter("jetsourcing_reactor_deliveries", "Messages a reactor's workers received.", ["reactor"])
REACTOR_REDELIVERIES = Counter("jetsourcing_reactor_redeliveries", "Messages a reactor's workers received that had "
                               "been delivered before.", ["reactor"])
REACTOR_DEAD_LETTERS = Counter("jetsourcing_reactor_dead_letters", "Messages a reactor's workers stored in the "
                               "dead-letter stream.", ["reactor"])

_serving: list[int] = []


def serving() -> bool:
    """Whether this process serves its metrics (measurements that cost a request are taken only then)."""
    return bool(_serving)


def serve_metrics(port: int, addr: str = "127.0.0.1") -> None:
    """Serve every metric of this process at ``http://addr:port/metrics`` from a background thread."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidArgumentError(f"The metrics port must be an int from 1 to 65535, not {port!r}.")
    try:
        start_http_server(port, addr)
    except OSError as exc:
        raise InvalidArgumentError(f"Cannot serve metrics on {addr}:{port}: {exc.strerror or exc}. Pick a free port.") from exc
    _serving.append(port)

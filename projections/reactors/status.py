"""What ``jetsourcing status`` shows of reactors: each one's consumer lag, redeliveries and dead letters.

A reactor's durable consumer is marked with the metadata key
:data:`REACTOR_METADATA` (set when a worker creates or aligns it), so any
process can list the reactors of a stream from the server alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

from eventstore import EventStore, StreamConfigError

from ..text import aligned
from .dead_letters import dead_letter_stream, dead_letter_subject

__all__ = ["REACTOR_METADATA", "ReactorStatus", "format_reactor_status", "read_reactor_status"]

REACTOR_METADATA: Final = "jetsourcing_reactor"
"""The consumer metadata key that marks a reactor's consumer (its value: the reactor's name)."""


@dataclass(frozen=True, slots=True)
class ReactorStatus:
    """One reactor, as its durable consumer and the dead-letter stream tell."""

    reactor: str
    pending: int
    """Commits not delivered yet: the reactor's lag."""
    ack_pending: int
    """Commits delivered and waiting for a verdict (handled now, or waiting for a retry)."""
    redelivered: int
    """Commits among those delivered more than once."""
    dead_letters: int
    """Dead letters stored for this reactor."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (``jetsourcing status --json``)."""
        return asdict(self)


async def read_reactor_status(store: EventStore) -> list[ReactorStatus]:
    """Every reactor of ``store``'s stream, by name."""
    consumers = await store.consumers()
    try:
        letters = await store.subject_counts(dead_letter_subject(store.settings), stream=dead_letter_stream(store.settings))
    except StreamConfigError:
        letters = {}  # no dead-letter stream: nothing was ever dead-lettered
    statuses = []
    for consumer in consumers:
        name = ((consumer.get("config") or {}).get("metadata") or {}).get(REACTOR_METADATA)
        if name:
            statuses.append(ReactorStatus(
                reactor=name,
                pending=int(consumer.get("num_pending") or 0),
                ack_pending=int(consumer.get("num_ack_pending") or 0),
                redelivered=int(consumer.get("num_redelivered") or 0),
                dead_letters=letters.get(dead_letter_subject(store.settings, name), 0),
            ))
    return sorted(statuses, key=lambda s: s.reactor)


def format_reactor_status(statuses: list[ReactorStatus]) -> str:
    """A plain-text table of the reactors (empty text when there are none)."""
    if not statuses:
        return ""
    rows = [("reactor", "pending", "in flight", "redelivered", "dead letters")]
    rows += [(s.reactor, str(s.pending), str(s.ack_pending), str(s.redelivered), str(s.dead_letters)) for s in statuses]
    return "\n".join(aligned(rows))

"""Which settings of an existing JetStream stream an event store can live with.

An event store promises that an acknowledged event is stored once, whole and
forever. :func:`config_problems` checks a stream's configuration (the raw JSON
the server reports, so settings that nats-py does not model are seen too)
against an allow-list: every setting of nats-server 2.15 is classified below,
and a setting this module does not know is refused unless it is unset. The stream
settings table in "Stream layout" of docs/concepts/event-store.md is this table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ALLOWED", "REFUSED", "config_problems"]

ALLOWED: dict[str, str] = {
    "name": "the stream's name",
    "description": "text only",
    "subjects": "must include the event store's subjects (<prefix>.>); other subjects do not touch events",
    "max_consumers": "too many consumers fail loudly when a reader starts; events are untouched",
    "max_msg_size": "a larger append is refused by the server; nothing is stored",
    "max_msgs": "only with discard policy new: once full, appends are refused (discard old drops the oldest events)",
    "max_bytes": "only with discard policy new: once full, appends are refused (discard old drops the oldest events)",
    "discard": "old or new; with a count or size limit it must be new",
    "num_replicas": "any",
    "placement": "where replicas run",
    "compression": "transparent to readers",
    "first_seq": "where positions start",
    "metadata": "text only",
    "consumer_limits": "limits on consumers; events are untouched",
    "mirror_direct": "only used by mirrors of this stream",
    "allow_batched": "another way to publish; stored messages are the same",
    "republish": "copies stored events to other subjects; the stored events are unchanged",
    "duplicate_window": "must be more than 0: idempotent retries rely on it",
    "persist_mode": "default only: async acknowledges before the write, so a crash loses acknowledged events",
}
"""Settings an event store accepts, with the condition (if any) and why."""

REFUSED: dict[str, str] = {
    "retention": "anything but limits (interest, workqueue) deletes events once consumed",
    "storage": "memory storage loses every event when the server restarts",
    "max_age": "expires old events whatever the discard policy (discard new does not keep them)",
    "max_msgs_per_subject": "a per-entity limit drops an entity's old events (discard old) or refuses its writes",
    "discard_new_per_subject": "belongs to per-subject limits, which are refused",
    "no_ack": "appends get no acknowledgement, so every append would be reported as failed although stored",
    "template_owner": "a stream template may delete the stream",
    "mirror": "a mirror refuses appends and holds another stream's messages",
    "sources": "sourced messages are written onto event subjects without the store's checks",
    "sealed": "a sealed stream refuses every append",
    "deny_delete": "must be on: otherwise single events can be deleted",
    "deny_purge": "must be on: otherwise the stream or an entity can be purged",
    "allow_rollup_hdrs": "a Nats-Rollup header purges an entity's earlier events",
    "allow_direct": "must be on: entities are read with direct gets",
    "allow_atomic": "must be on: multi-entity appends are atomic batches",
    "subject_transform": "rewrites the subject an event is stored under, so it leaves its entity",
    "allow_msg_ttl": "a Nats-TTL header on any message makes it expire",
    "subject_delete_marker_ttl": "places server-written markers on event subjects when messages are removed",
    "allow_msg_counter": "a counter stream refuses ordinary messages and rewrites values",
    "allow_msg_schedules": "scheduled messages are published later by the server, onto event subjects",
}
"""Settings an event store refuses when set (or, where noted, when not set), and why."""


def _unset(value: Any) -> bool:
    return value in (None, False, 0, "", [], {})


def _limit(value: Any) -> bool:
    return isinstance(value, int) and value > 0


# key -> predicate that is True when the value is acceptable; keys in ALLOWED without an entry accept anything.
_ACCEPTABLE: dict[str, Callable[[Any, Mapping[str, Any]], bool]] = {
    "retention": lambda v, c: v in (None, "limits"),
    "storage": lambda v, c: v in (None, "file"),
    "max_age": lambda v, c: _unset(v),
    "max_msgs": lambda v, c: not _limit(v) or c.get("discard") == "new",
    "max_bytes": lambda v, c: not _limit(v) or c.get("discard") == "new",
    "max_msgs_per_subject": lambda v, c: not _limit(v),
    "discard_new_per_subject": lambda v, c: not v,
    "no_ack": lambda v, c: not v,
    "template_owner": lambda v, c: not v,
    "mirror": lambda v, c: not v,
    "sources": lambda v, c: not v,
    "sealed": lambda v, c: not v,
    "deny_delete": lambda v, c: v is True,
    "deny_purge": lambda v, c: v is True,
    "allow_rollup_hdrs": lambda v, c: not v,
    "allow_direct": lambda v, c: v is True,
    "allow_atomic": lambda v, c: v is True,
    "subject_transform": lambda v, c: not v,
    "allow_msg_ttl": lambda v, c: not v,
    "subject_delete_marker_ttl": lambda v, c: _unset(v),
    "allow_msg_counter": lambda v, c: not v,
    "allow_msg_schedules": lambda v, c: not v,
    "duplicate_window": lambda v, c: isinstance(v, (int, float)) and v > 0,
    "persist_mode": lambda v, c: v in (None, "", "default"),
}

# Settings that must be present and on (the server omits false values from its JSON).
_REQUIRED_ON = ("deny_delete", "deny_purge", "allow_direct", "allow_atomic")


def config_problems(config: Mapping[str, Any], subjects: str) -> list[str]:
    """Why a stream with ``config`` (the server's JSON) cannot hold an event store on ``subjects``; [] if it can."""
    problems = []
    if subjects not in (config.get("subjects") or []):
        problems.append(f"subjects {config.get('subjects')} do not include {subjects!r}")
    for key in sorted(set(config) | set(_REQUIRED_ON)):
        value = config.get(key)
        acceptable = _ACCEPTABLE.get(key)
        if acceptable is not None:
            if not acceptable(value, config):
                reason = REFUSED.get(key) or ALLOWED[key]
                problems.append(f"{key}={value!r}: {reason}")
        elif key not in ALLOWED and not _unset(value):
            problems.append(
                f"{key}={value!r}: a setting this version of jetsourcing does not know, so it cannot tell whether "
                "acknowledged events stay stored"
            )
    return problems

"""Status of the projections in a read-model store, readable from any process.

Everything comes from the store (checkpoints, the daemon's recorded state and
heartbeat, rebuild progress, dead letters, the last error) plus two questions
to the server: the stream's last position, and how many commits after each
checkpoint match the projection's categories (and when the oldest of them was
recorded: the lag in seconds). ``state`` is one of:

``running``     a daemon owns it and its heartbeat is fresh
``rebuilding``  a rebuild is filling a new generation (the live one is still served)
``stopped``     the daemon stopped cleanly (or caught up in burst mode)
``error``       stopped by a handler failure; ``error`` holds the report
``stale``       recorded as running, but no heartbeat for ``stale_after_s``: the daemon died
``new``         created, never run
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any


from eventstore import EventStore, EventStoreError

from .backends import open_store
from .connection import connect_event_store
from .reactors.status import ReactorStatus, read_reactor_status
from .settings import ProjectionSettings
from .text import aligned
from .store import GenerationState, ReadModelStore, RunState, StoredStatus

__all__ = ["ProjectionStatus", "RebuildStatus", "format_status", "read_status", "read_statuses"]


@dataclass(frozen=True, slots=True)
class RebuildStatus:
    """A generation being built by a rebuild."""

    generation: int
    version: int
    checkpoint: int
    target: int | None
    active: bool
    """False when nobody is building it: the rebuild was interrupted or died (``--resume`` goes on with it)."""
    heartbeat_age_s: float | None


@dataclass(frozen=True, slots=True)
class ProjectionStatus:
    """One projection's status; ``lag_*`` and ``last_position`` are None when the server could not be asked."""

    projection: str
    state: str
    version: int | None
    generation: int | None
    checkpoint: int
    last_position: int | None
    lag_commits: int | None
    """Commits of the projection's categories after the checkpoint (one append to one entity = one commit)."""
    lag_s: float | None
    """How long the oldest unapplied commit has been waiting (0 when caught up)."""
    owner: str | None
    heartbeat_age_s: float | None
    dead_letters: int
    error: dict[str, Any] | None
    rebuild: RebuildStatus | None
    counters: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (``jetsourcing status --json``)."""
        return asdict(self)


async def read_status(
    settings: ProjectionSettings | None = None,
    *,
    event_store: EventStore | None = None,
    store: ReadModelStore | None = None,
) -> list[ProjectionStatus]:
    """The status of every projection in the store (``settings.database`` unless ``store`` is given).

    Reading creates nothing: where there are no read models yet (no SQLite file, no PostgreSQL schema, or
    nothing run there), :class:`~projections.errors.ReadModelNotFoundError` says so.
    """
    settings = settings or ProjectionSettings()
    if store is not None:
        stored = await store.offload(store.statuses)
    else:
        stored = await asyncio.to_thread(_stored_statuses, settings)
    es = event_store
    own_es = False
    if es is None and settings.eventstore.nats_url:
        try:
            es = await connect_event_store(settings)
            own_es = True
        except Exception:  # noqa: BLE001 - status still shows what the store knows
            es = None
    try:
        last = None
        if es is not None:
            try:
                last = await es.last_position()
            except Exception:  # noqa: BLE001
                es = None
        return [await _status(s, settings, es, last) for s in stored]
    finally:
        if own_es and es is not None:
            await es.close()


def _stored_statuses(settings: ProjectionSettings) -> list[StoredStatus]:
    with contextlib.closing(open_store(settings, create=False)) as store:
        return store.statuses()


async def read_statuses(settings: ProjectionSettings) -> tuple[list[ProjectionStatus], list[ReactorStatus] | None]:
    """The projections' status and the reactors' (None when the server cannot be asked): ``jetsourcing status``.

    Creates nothing, as :func:`read_status`."""
    try:
        es = await connect_event_store(settings)
    except EventStoreError:
        # What the read-model store alone knows (without a second wait for the same server).
        return await read_status(settings.model_copy(update={"eventstore": settings.eventstore.model_copy(
            update={"nats_url": None})})), None
    try:
        try:
            reactors: list[ReactorStatus] | None = await read_reactor_status(es)
        except EventStoreError:
            reactors = None
        return await read_status(settings, event_store=es), reactors
    finally:
        await es.close()


async def _status(s: StoredStatus, settings: ProjectionSettings, es: EventStore | None, last: int | None) -> ProjectionStatus:
    now = time.time()
    live = s.live
    checkpoint = live.checkpoint if live else 0
    heartbeat_age = now - live.heartbeat_at if live and live.heartbeat_at else None
    state = s.state.value
    if s.state is RunState.RUNNING and (heartbeat_age is None or heartbeat_age > settings.stale_after_s):
        state = "stale"
    rebuild = None
    if s.building is not None and s.building.state is GenerationState.BUILDING:
        b = s.building
        age = now - b.heartbeat_at if b.heartbeat_at else None
        active = age is not None and age <= settings.stale_after_s
        rebuild = RebuildStatus(b.generation, b.version, b.checkpoint, b.target, active, age)
        if active:
            state = "rebuilding"
    lag_commits = lag_s = None
    if es is not None and last is not None and live is not None:
        try:
            lag_commits, lag_s = await _lag(es, live.definition.get("categories"), checkpoint, last)
        except EventStoreError:  # the server did not answer: leave the lag unknown
            pass
    return ProjectionStatus(
        projection=s.projection,
        state=state,
        version=live.version if live else None,
        generation=live.generation if live else None,
        checkpoint=checkpoint,
        last_position=last,
        lag_commits=lag_commits,
        lag_s=lag_s,
        owner=s.owner,
        heartbeat_age_s=heartbeat_age,
        dead_letters=s.dead_letters,
        error=s.error if s.state is RunState.ERROR else None,
        rebuild=rebuild,
        counters=s.counters,
    )


async def _lag(es: EventStore, categories: list[str] | None, checkpoint: int, last: int) -> tuple[int, float]:
    """(commits after ``checkpoint`` matching ``categories``, age in seconds of the first of them)."""
    if checkpoint >= last:
        return 0, 0.0
    pending = await es.pending(checkpoint, categories)
    return pending.commits, pending.age_s()


def format_status(statuses: list[ProjectionStatus]) -> str:
    """A plain-text table, then one paragraph per projection with an error, a rebuild or dead letters."""
    if not statuses:
        return "No projections in this database yet."
    header = ("projection", "state", "version", "gen", "checkpoint", "last pos", "lag (commits)", "lag (s)", "dead")
    rows = [header]
    for s in statuses:
        rows.append((
            s.projection,
            s.state,
            str(s.version or "-"),
            str(s.generation or "-"),
            str(s.checkpoint),
            "?" if s.last_position is None else str(s.last_position),
            "?" if s.lag_commits is None else str(s.lag_commits),
            "?" if s.lag_s is None else f"{s.lag_s:.1f}",
            str(s.dead_letters),
        ))
    lines = aligned(rows)
    for s in statuses:
        if s.rebuild is not None:
            r = s.rebuild
            target = f"/{r.target}" if r.target else ""
            what = "rebuilding" if r.active else "interrupted rebuild (`jetsourcing rebuild --resume` goes on with it)"
            lines.append(f"{s.projection}: {what}: generation {r.generation} (version {r.version}) at "
                         f"{r.checkpoint}{target}")
        if s.state == "stale":
            age = "never" if s.heartbeat_age_s is None else f"{s.heartbeat_age_s:.0f}s ago"
            lines.append(f"{s.projection}: recorded as running by {s.owner}, but its last heartbeat was {age}: "
                         "the daemon died? Start it again.")
        if s.error:
            e = s.error
            where = (f" at position {e['position']} (event {e.get('event_type')!r} of {e.get('stream_id')}, "
                     f"index {e.get('index')}, id {e.get('event_id')})" if "position" in e else "")
            lines.append(f"{s.projection}: STOPPED WITH ERROR{where}: {e.get('error')}")
            if e.get("traceback"):
                lines.extend("    " + line for line in str(e["traceback"]).rstrip().splitlines())
        if s.dead_letters:
            lines.append(f"{s.projection}: {s.dead_letters} dead-lettered commit(s) in _jetsourcing_dead_letters.")
    return "\n".join(lines)

"""Helpers of the projection tests: settings, burst runs, dumps, clean rebuilds, CLI subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from eventstore import EventStore, EventStoreSettings
from projections import Daemon, MemoryStore, Projection, ProjectionSettings, fold, open_store

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

both_stores = pytest.mark.parametrize("psettings", ["sqlite", "postgres"], indirect=True)
"""Run the test once with the read models in SQLite, once in PostgreSQL (see the ``psettings`` fixture)."""


def make_settings(nats_url: str, database: Path | str, **overrides: object) -> ProjectionSettings:
    """Settings on a stream, subject prefix and lease bucket no other test uses, with short timings."""
    tag = uuid.uuid4().hex[:10]
    values: dict[str, object] = {
        "eventstore": EventStoreSettings(nats_url=nats_url, stream=f"P{tag}", subject_prefix=f"p{tag}"),
        "database": database,
        "lease_bucket": f"L{tag}",
        "lease_ttl_s": 2.0,
        "status_interval_s": 0.2,
        "stale_after_s": 3.0,
        "heartbeat_s": 0.5,
    }
    values.update(overrides)
    return ProjectionSettings(**values)  # type: ignore[arg-type]


async def burst(projections: Sequence[Projection], settings: ProjectionSettings, es: EventStore | None = None) -> None:
    """Run the daemon in burst mode (the production code path) and check every projection caught up."""
    async with asyncio.timeout(120):  # a hang fails here, with the awaited frame in the traceback
        outcomes = await Daemon(projections, settings, event_store=es).run(until_caught_up=True)
    assert all(o.value == "caught_up" for o in outcomes.values()), outcomes


def dump(settings: ProjectionSettings, name: str) -> dict[str, list[dict[str, object]]]:
    """What readers see of projection ``name``."""
    with contextlib.closing(open_store(settings)) as store:
        return store.dump(name)


async def clean_rebuild(projection: Projection, settings: ProjectionSettings, es: EventStore, tmp: Path) -> dict[str, list[dict[str, object]]]:
    """The read model a clean full replay into a brand-new database gives."""
    fresh = settings.model_copy(update={"database": tmp / f"clean-{uuid.uuid4().hex[:6]}.sqlite3"})
    await burst([projection], fresh, es)
    return dump(fresh, projection.name)


async def memory_fold(projection: Projection, es: EventStore) -> dict[str, list[dict[str, object]]]:
    """The read model the in-memory fold (what Spark runs) gives over the whole stream."""
    projection.bind(es.registry)
    store = MemoryStore.for_projection(projection)
    async with asyncio.timeout(120):
        async for batch in es.read_all(categories=projection.categories):
            fold(projection, batch, store)
    return store.dump()


def cli(*args: str) -> list[str]:
    """argv running the jetsourcing CLI in a subprocess."""
    return [sys.executable, "-m", "projections.cli", *args]


def cli_env(settings: ProjectionSettings) -> dict[str, str]:
    """Environment of a CLI subprocess: the test's server, stream, database and lease bucket."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_")}
    es_settings = settings.eventstore
    env.update({
        "NATS_URL": str(es_settings.nats_url),
        "JETSOURCING_STREAM": es_settings.stream,
        "JETSOURCING_SUBJECT_PREFIX": es_settings.subject_prefix,
        "JETSOURCING_DATABASE": str(settings.database),
        "JETSOURCING_POSTGRES_SCHEMA": settings.postgres_schema,
        "JETSOURCING_LEASE_BUCKET": settings.lease_bucket,
        "JETSOURCING_LEASE_TTL_S": str(settings.lease_ttl_s),
        "JETSOURCING_STATUS_INTERVAL_S": str(settings.status_interval_s),
        "JETSOURCING_STALE_AFTER_S": str(settings.stale_after_s),
        "JETSOURCING_HEARTBEAT_S": str(settings.heartbeat_s),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
    })
    return env


def spawn(settings: ProjectionSettings, *args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    """Start the CLI in a subprocess (caller waits or kills it)."""
    return subprocess.Popen(cli(*args), env=cli_env(settings), cwd=ROOT, **kwargs)  # type: ignore[call-overload]


def checkpoint(settings: ProjectionSettings, name: str) -> int:
    """The live generation's checkpoint of projection ``name`` (0 before its first run)."""
    with contextlib.closing(open_store(settings)) as store:
        live = store.live_generation(name)
        return live.checkpoint if live else 0


async def wait_until(condition: Callable[[], object], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll ``condition`` every 20 ms until it is true; fail after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


def tables_in(settings: ProjectionSettings) -> set[str]:
    """The tables (not views) in the read-model database."""
    with contextlib.closing(open_store(settings)) as store:
        return {name for name, kind in store.relations() if kind == "table"}  # type: ignore[attr-defined]


def count_rows(settings: ProjectionSettings, table: str = "balances") -> int:
    """What a reader counts in ``table`` of the live read model."""
    with contextlib.closing(open_store(settings)) as store:
        return len(store.rows(table))

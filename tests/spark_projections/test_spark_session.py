"""The session helper: configuration, Delta verification, worker interpreter."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StringType

from eventstore import EventStore, StreamId
from spark_projections.jars import delta_coordinate
from spark_projections.session import (
    DELTA_CATALOG,
    DELTA_EXTENSION,
    SparkSettings,
    build_conf,
    ensure_delta,
    spark_session,
)
from spark_projections.settings import DELTA_MAVEN_VERSION


def test_build_conf_online_mode(tmp_path: Path) -> None:
    conf = build_conf(SparkSettings.test_profile(delta_jars_dir=None, delta_jars_cache=tmp_path / "empty-cache"))
    assert conf["spark.master"] == "local[2]"
    assert conf["spark.ui.enabled"] == "false"
    assert conf["spark.sql.shuffle.partitions"] == "2"
    assert conf["spark.pyspark.python"] == sys.executable
    assert conf["spark.pyspark.driver.python"] == sys.executable
    assert conf["spark.sql.extensions"] == DELTA_EXTENSION
    assert conf["spark.sql.catalog.spark_catalog"] == DELTA_CATALOG
    assert conf["spark.jars.packages"] == delta_coordinate(DELTA_MAVEN_VERSION)
    assert "spark.jars" not in conf
    assert conf["spark.driver.bindAddress"] == "127.0.0.1"
    assert conf["spark.databricks.delta.snapshotPartitions"] == "2"
    assert conf["spark.sql.codegen.cache.maxEntries"] == "1000"


def test_extra_conf_overrides_but_list_keys_merge() -> None:
    settings = SparkSettings.test_profile(
        delta_jars_dir=None,
        extra_conf={
            "spark.sql.shuffle.partitions": "7",
            "spark.sql.extensions": "com.example.Ext",
            "spark.jars.packages": "org.example:thing:1.0",
        },
    )
    conf = build_conf(settings)
    assert conf["spark.sql.shuffle.partitions"] == "7"
    assert conf["spark.sql.extensions"] == f"{DELTA_EXTENSION},com.example.Ext"
    assert conf["spark.jars.packages"] == f"{delta_coordinate(DELTA_MAVEN_VERSION)},org.example:thing:1.0"


def test_settings_read_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JETSOURCING_SPARK_MASTER", "local[3]")
    monkeypatch.setenv("JETSOURCING_SPARK_DELTA_JARS_DIR", str(tmp_path))
    monkeypatch.setenv("JETSOURCING_SPARK_EXTRA_CONF", '{"spark.driver.memory": "2g"}')
    settings = SparkSettings()
    assert settings.master == "local[3]"
    assert settings.delta_jars_dir == tmp_path
    assert settings.extra_conf == {"spark.driver.memory": "2g"}
    # Explicit arguments beat the environment.
    assert SparkSettings.test_profile().master == "local[2]"


def test_missing_offline_folder_is_a_typed_error_before_spark(tmp_path: Path, run_python: Any) -> None:
    # A fresh interpreter: the jars settings only matter to a call that starts the JVM.
    missing = tmp_path / "no-such-folder"
    result = run_python(
        "from pyspark import SparkContext\n"
        "from spark_projections.session import spark_session, SparkSettings\n"
        "from spark_projections.errors import DeltaJarsUnavailableError\n"
        "try:\n"
        f"    spark_session(SparkSettings.test_profile(delta_jars_dir={str(missing)!r}))\n"
        "except DeltaJarsUnavailableError as e:\n"
        "    print(e.problem, SparkContext._gateway is None, e)\n",
    )
    assert result.stdout.startswith("offline_dir_missing True "), result.stdout + result.stderr[-3000:]
    assert str(missing) in result.stdout and "fetch-delta-jars" in result.stdout


def test_a_running_jvm_ignores_the_jars_settings(spark: SparkSession, tmp_path: Path) -> None:
    # Its classpath is fixed: nothing to validate or resolve, whatever the settings say.
    again = spark_session(SparkSettings.test_profile(delta_jars_dir=tmp_path / "no-such-folder"))
    assert again.sparkContext is spark.sparkContext


def test_session_has_delta_and_test_profile(spark: SparkSession) -> None:
    ensure_delta(spark)  # raises if not
    assert spark.sparkContext.master == "local[2]"
    assert spark.conf.get("spark.sql.shuffle.partitions") == "2"
    assert spark.conf.get("spark.ui.enabled") == "false"
    assert spark.sparkContext.uiWebUrl is None


def test_python_workers_run_this_interpreter(spark: SparkSession) -> None:
    # A UDF executes in a Python worker process: it must be this venv's interpreter,
    # not whatever `python3` is first on PATH.
    def executable(_):  # type: ignore[no-untyped-def]  # hints would make PySpark guess an eval type
        import sys as worker_sys

        return worker_sys.executable

    udf = F.udf(executable, StringType())
    seen = {row[0] for row in spark.range(4).select(udf("id")).collect()}
    assert seen == {sys.executable}


def test_spark_session_reuses_the_running_session(spark: SparkSession) -> None:
    again = spark_session(SparkSettings.test_profile())
    assert again.sparkContext is spark.sparkContext
    assert again is spark or again.sparkContext._jsc == spark.sparkContext._jsc


def test_a_session_without_delta_is_detected(run_python: Any) -> None:
    # Something else created a plain session first; ours cannot add Delta to that JVM.
    result = run_python(
        "from pyspark.sql import SparkSession\n"
        "from spark_projections.session import spark_session, SparkSettings\n"
        "from spark_projections.errors import DeltaNotConfiguredError\n"
        "SparkSession.builder.master('local[1]').config('spark.ui.enabled', 'false')"
        ".config('spark.driver.bindAddress', '127.0.0.1').config('spark.driver.host', '127.0.0.1')"
        ".getOrCreate()\n"
        "try:\n"
        "    spark_session(SparkSettings.test_profile(master='local[1]'))\n"
        "except DeltaNotConfiguredError as e:\n"
        "    print('DETECTED:', e)\n",
    )
    assert result.stdout.startswith("DETECTED: This Spark session was created without Delta Lake"), (
        result.stdout + result.stderr[-3000:]
    )
    assert "restart the Python process" in result.stdout


class Noted(BaseModel):
    text: str


async def test_the_jetstream_format_works_on_every_session_spark_session_returns(
    run_python: Any, store: EventStore
) -> None:
    """The Spark page's ``spark.read.format("jetstream")`` without a ``read_events`` first: in a new JVM, and from a
    JVM that already runs, whose next session (after ``stop()``) starts without the registration."""
    store.registry.register(Noted)
    for i in range(5):
        await store.append(StreamId("Note", f"n{i % 2}"), [Noted(text=f"t{i}")])
    settings = store.settings
    result = run_python(
        "from spark_projections.session import spark_session, SparkSettings\n"
        "def count(spark):\n"
        f"    return (spark.read.format('jetstream').option('url', {settings.nats_url!r})"
        f".option('stream', {settings.stream!r}).option('subject_prefix', {settings.subject_prefix!r})"
        ".load().count())\n"
        "spark = spark_session(SparkSettings.test_profile())\n"
        "print('NEW JVM', count(spark))\n"
        "spark.stop()\n"
        "print('REUSED JVM', count(spark_session(SparkSettings.test_profile())))\n",
    )
    assert result.stdout.splitlines() == ["NEW JVM 5", "REUSED JVM 5"], result.stdout + result.stderr[-3000:]

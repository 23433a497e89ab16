"""The driver's preflight for what executors need: a NATS URL they can reach, the settings' files where they look,
the jars Spark lists, and the user's modules (an executor's ModuleNotFoundError, named with what to do). What needs
executors of their own (files and jars missing there) runs in test_cluster.py."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from eventstore import EventStore, EventStoreSettings
from spark_projections import DeltaJarsUnavailableError, follow, rebuild
from spark_projections.errors import EventSourceError, ExecutorSetupError
from spark_projections.executors import check_executor_files, check_reachable, executor_imports, separate_executors
from spark_projections.jars import check_listed_jars
from spark_projections.ship import SHIP_CODE_CONF


CREDS = "-----BEGIN NATS USER JWT-----\nx\n------END NATS USER JWT------\n-----BEGIN USER NKEY SEED-----\nSU\n"


@pytest.mark.parametrize("url", ["nats://127.0.0.1:4222", "nats://localhost:4222", "nats://[::1]:4222",
                                 "127.0.0.1:4222", "nats://127.0.0.1:4222,nats://localhost:4223",
                                 "tls://user:secret@127.0.0.2:4222"])
def test_a_loopback_url_is_refused_under_a_cluster_master(url: str) -> None:
    spark = SimpleNamespace(sparkContext=SimpleNamespace(master="spark://host:7077"))
    with pytest.raises(EventSourceError, match="is a loopback address, but Spark's master is 'spark://host:7077'") as refused:
        check_reachable(spark, url)  # type: ignore[arg-type]
    assert "secret" not in str(refused.value)


@pytest.mark.parametrize(("master", "url"), [
    ("local[2]", "nats://127.0.0.1:4222"),
    ("local-cluster[2,1,1024]", "nats://127.0.0.1:4222"),  # executors on this host
    ("spark://host:7077", "nats://nats.internal:4222"),
    ("yarn", "nats://127.0.0.1:4222,nats://10.0.0.5:4222"),  # one server the executors can reach
])
def test_a_reachable_url_or_a_local_master_passes(master: str, url: str) -> None:
    check_reachable(SimpleNamespace(sparkContext=SimpleNamespace(master=master)), url)  # type: ignore[arg-type]


@pytest.mark.parametrize(("master", "separate"), [
    ("local", False), ("local[2]", False), ("local[*]", False), ("local[4,2]", False),
    ("local-cluster[2,1,1024]", True), ("spark://host:7077", True), ("yarn", True), ("k8s://https://api:6443", True),
])
def test_only_a_local_master_shares_the_drivers_process(master: str, separate: bool) -> None:
    assert separate_executors(SimpleNamespace(sparkContext=SimpleNamespace(master=master))) is separate  # type: ignore[arg-type]


def test_under_a_local_master_the_files_are_not_looked_for_again(spark: SparkSession, tmp_path: Path) -> None:
    creds = tmp_path / "app.creds"
    creds.write_text(CREDS)
    settings = EventStoreSettings(nats_url="nats://nats.internal:4222", credentials_file=creds)
    tracker = spark.sparkContext.statusTracker()
    before = set(tracker.getJobIdsForGroup(None))
    check_executor_files(spark, settings)  # the settings checked the file: the executors share this host's files
    assert set(tracker.getJobIdsForGroup(None)) == before


def test_listed_jars_must_exist_here_and_local_ones_are_returned_for_the_executors(tmp_path: Path) -> None:
    jar = tmp_path / "delta spark.jar"
    jar.write_bytes(b"PK")
    listed = f"{jar.as_uri()}, ,local:{jar},hdfs://nn/x.jar,https://repo/y.jar,{jar}"
    assert check_listed_jars(listed) == [jar]  # remote ones are Spark's to fetch
    assert check_listed_jars("") == []
    for missing in (str(tmp_path / "nope.jar"), (tmp_path / "nope.jar").as_uri(), f"local:{tmp_path}/nope.jar"):
        with pytest.raises(DeltaJarsUnavailableError, match="spark.jars lists .*nope.jar, but there is no file") as e:
            check_listed_jars(f"{jar},{missing}")
        assert e.value.problem == "jar_missing"


def test_a_session_listing_a_missing_jar_fails_before_its_jvm_starts(run_python: Callable[..., Any], tmp_path: Path) -> None:
    done = run_python(
        "from spark_projections import SparkSettings, spark_session\n"
        "from pyspark import SparkContext\n"
        "try:\n"
        f"    spark_session(SparkSettings(extra_conf={{'spark.jars': '{tmp_path}/gone.jar'}}))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc.problem, SparkContext._gateway is None)\n",
        timeout=60,
    )
    assert done.stdout.strip() == "DeltaJarsUnavailableError jar_missing True", done.stderr[-2000:]


def uninstalled(folder: Path, name: str, text: str) -> ModuleType:
    """A module of the user's in ``folder``, imported from there and on no executor's path."""
    (folder / f"{name}.py").write_text(text)
    sys.path.insert(0, str(folder))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(folder))


VIEWS = '''
from pydantic import BaseModel
from eventstore import RecordedEvent
from projections import Projection, Table, Transaction, handles
{imports}

class Noted(BaseModel):
    text: str


class Notes(Projection):
    name = "notes_{suffix}"
    categories = ("Note",)
    tables = (Table("notes_{suffix}", key="note", columns={{"note": str, "text": str}}),)

    @handles(Noted)
    def noted(self, event: RecordedEvent, tx: Transaction) -> None:
        tx.upsert("notes_{suffix}", event.stream_id.entity_id, {{"text": {text}}})
'''


@pytest.fixture
def modules() -> object:
    """Forget the modules a test imported from its temporary folders."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


async def noted(store: EventStore, model: type) -> None:
    from eventstore import StreamId

    store.registry.register(model)
    await store.append(StreamId("Note", "n1"), [model(text="hello")])


@pytest.fixture
async def unshipped(
    spark: SparkSession, store: EventStore, tmp_path: Path, modules: object
) -> AsyncIterator[ModuleType]:
    """A projection module of the user's (``views_<suffix>``), its event in the stream, and shipping off."""
    views = uninstalled(tmp_path, f"views_{uuid.uuid4().hex[:8]}", VIEWS.format(
        imports="", suffix=uuid.uuid4().hex[:8], text="event.data.text"))
    await noted(store, views.Noted)
    spark.conf.set(SHIP_CODE_CONF, "false")
    try:
        yield views
    finally:
        spark.conf.unset(SHIP_CODE_CONF)


def test_an_executor_that_cannot_import_the_projection_says_that_shipping_is_off(
    spark: SparkSession, store: EventStore, tmp_path: Path, unshipped: ModuleType
) -> None:
    with pytest.raises(ExecutorSetupError) as refused:
        rebuild(spark, unshipped.Notes(), store.settings, tmp_path / "lake")
    message = str(refused.value)
    assert f"cannot import '{unshipped.__name__}' (ModuleNotFoundError)" in message
    assert "shipping the projection's code to the executors is off (spark.jetsourcing.shipCode=false" in message
    assert not (tmp_path / "lake").exists()  # nothing written


async def test_a_module_the_projection_imports_from_elsewhere_is_named_as_not_shipped(
    spark: SparkSession, store: EventStore, tmp_path: Path, modules: object
) -> None:
    suffix = uuid.uuid4().hex[:8]
    (tmp_path / "lib").mkdir()
    uninstalled(tmp_path / "lib", f"helper_{suffix}", "def shout(text):\n    return text.upper()\n")
    views = uninstalled(tmp_path, f"views_{suffix}", VIEWS.format(
        imports=f"import helper_{suffix}", suffix=suffix, text=f"helper_{suffix}.shout(event.data.text)"))
    await noted(store, views.Noted)
    with pytest.raises(ExecutorSetupError) as refused:  # the views module is shipped; the helper it imports is not
        rebuild(spark, views.Notes(), store.settings, tmp_path / "lake")
    message = str(refused.value)
    assert f"cannot import 'helper_{suffix}' (ModuleNotFoundError)" in message
    assert f"Install 'helper_{suffix}' on every executor" in message


def test_a_follower_whose_executors_cannot_import_the_projection_keeps_the_named_error(
    spark: SparkSession, store: EventStore, tmp_path: Path, unshipped: ModuleType
) -> None:
    follower = follow(spark, unshipped.Notes(), store.settings, tmp_path / "lake", available_now=True)
    with pytest.raises(StreamingQueryException):
        follower.await_termination(120)
    assert isinstance(follower.error, ExecutorSetupError)
    assert f"cannot import '{unshipped.__name__}' (ModuleNotFoundError)" in str(follower.error)


def test_a_module_missing_on_the_driver_is_not_taken_for_an_executors(spark: SparkSession) -> None:
    # Only the errors Spark hands over from its workers are read: the driver's own import error passes unchanged.
    with pytest.raises(ModuleNotFoundError, match="no_such_module"), executor_imports(spark):
        import no_such_module  # type: ignore[import-not-found]  # noqa: F401

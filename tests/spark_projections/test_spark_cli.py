"""``jetsourcing spark rebuild|update``: the Spark options, refused when wrong, and a real run from a fresh
process that starts from the jars cache without Ivy."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from eventstore import EventStore
from projections.cli import main as jetsourcing
from spark_projections.cli import add_common_options, main, spark_settings
from spark_projections.jars import (
    cached_delta_jars,
    delta_coordinate,
    jars_cache_folder,
    session_jars,
    store_delta_jars,
)
from spark_projections.settings import DELTA_MAVEN_VERSION, TEST_PROFILE_CONF

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "tests" / "projections"
sys.path.insert(0, str(EXAMPLES))

from projection_examples import append_workload, register_all, workload  # noqa: E402

BAD_OPTIONS = [
    (["--master", "foo"], "argument --master: 'foo' is not a Spark master. Spark takes local, local[N]"),
    (["--master", "local[0]"], "argument --master: 'local[0]' is not a Spark master"),
    (["--master", "local[-2]"], "argument --master: 'local[-2]' is not a Spark master"),
    (["--master", "spark://"], "argument --master: 'spark://' is not a Spark master"),
    (["--master", ""], "argument --master: '' is not a Spark master"),
    (["--shuffle-partitions", "0"], "argument --shuffle-partitions: '0' is not a whole number of at least 1"),
    (["--shuffle-partitions", "-4"], "argument --shuffle-partitions: '-4' is not a whole number of at least 1"),
    (["--shuffle-partitions", "2.5"], "argument --shuffle-partitions: '2.5' is not a whole number of at least 1"),
    (["--shuffle-partitions", "many"], "argument --shuffle-partitions: 'many' is not a whole number of at least 1"),
    (["--shuffle-partitions"], "argument --shuffle-partitions: expected one argument"),
]


@pytest.fixture
def own_logging() -> Iterator[None]:
    """The `jetsourcing` entry point configures the root logger for its process; give it back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("own_logging")
@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS, ids=[" ".join(o) for o, _ in BAD_OPTIONS])
@pytest.mark.parametrize("command", ["rebuild", "update"])
def test_bad_spark_options_are_refused_before_anything_runs(
    command: str, options: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Through the `jetsourcing` entry point, as a user types it; nothing is imported, contacted or started.
    with pytest.raises(SystemExit) as exited:
        jetsourcing(["spark", command, "no_such_module:X", "--root", str(tmp_path), *options])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"jetsourcing spark {command}: error: {message}" in err, err
    assert "Traceback" not in err and "No module named" not in err


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("JETSOURCING_SPARK_MASTER", "foo", "JETSOURCING_SPARK_MASTER='foo' is not valid: 'foo' is not a Spark master."),
    ("JETSOURCING_SPARK_SHUFFLE_PARTITIONS", "0",
     "JETSOURCING_SPARK_SHUFFLE_PARTITIONS='0' is not valid: Input should be greater than 0"),
])
def test_bad_spark_variables_are_one_line_errors(
    variable: str, value: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(variable, value)
    # Refused before the server is asked anything (there is no server at this URL) or Spark starts.
    args = ["update", "projection_examples:Movements", "--root", str(tmp_path), "--nats-url", "nats://127.0.0.1:9"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == f"jetsourcing: {message}\n" or err.startswith(f"jetsourcing: {message}"), err
    assert "Traceback" not in err


def test_the_options_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETSOURCING_SPARK_MASTER", "not a master")  # overridden, so never looked at
    monkeypatch.setenv("JETSOURCING_SPARK_SHUFFLE_PARTITIONS", "5")
    monkeypatch.setenv("JETSOURCING_SPARK_APP_NAME", "from-the-environment")
    parser = argparse.ArgumentParser()
    add_common_options(parser)
    args = parser.parse_args(["m:P", "--root", "r", "--master", "local[1]", "--shuffle-partitions", "3"])
    settings = spark_settings(args)
    assert (settings.master, settings.shuffle_partitions, settings.app_name) == ("local[1]", 3, "from-the-environment")
    monkeypatch.setenv("JETSOURCING_SPARK_MASTER", "local[2]")
    assert spark_settings(parser.parse_args(["m:P", "--root", "r"])).master == "local[2]"
    assert spark_settings(parser.parse_args(["m:P", "--root", "r"])).shuffle_partitions == 5


async def test_a_cli_update_starts_from_the_jars_cache_quietly_with_the_options(
    spark: SparkSession, store: EventStore, tmp_path: Path, run_python: Any
) -> None:
    """The real command in a fresh process, its Ivy unable to reach any repository: the session starts from the
    cache, the options beat the environment, and stderr holds no start-up report nor routine messages."""
    register_all(store)
    await append_workload(store, workload(40, 4, seed=5))
    cache = tmp_path / "cache"
    store_delta_jars(session_jars(spark), jars_cache_folder(cache, DELTA_MAVEN_VERSION), delta_coordinate(DELTA_MAVEN_VERSION))
    unreachable = tmp_path / "unreachable.xml"
    unreachable.write_text(
        '<ivysettings><settings defaultResolver="main"/><resolvers><chain name="main">'
        '<ibiblio name="unreachable" m2compatible="true" root="http://127.0.0.1:9/maven2/"/>'
        "</chain></resolvers></ivysettings>"
    )
    settings = store.settings
    argv = ["spark", "update", "projection_examples:Movements", "--root", str(tmp_path / "lake"),
            "--nats-url", str(settings.nats_url), "--stream", settings.stream, "--subject-prefix", settings.subject_prefix,
            "--master", "local[1]", "--shuffle-partitions", "3"]
    result = run_python(
        f"import sys\nfrom projections.cli import main\nsys.exit(main({argv!r}))\n",
        env={
            "PYTHONPATH": f"{REPO_ROOT}:{EXAMPLES}",  # the executors import the projection from there
            "JETSOURCING_SPARK_DELTA_JARS_CACHE": str(cache),
            "JETSOURCING_SPARK_MASTER": "local[2]",
            "JETSOURCING_SPARK_SHUFFLE_PARTITIONS": "7",
            "JETSOURCING_SPARK_STARTUP_LOG": str(tmp_path / "startup.log"),
            "JETSOURCING_SPARK_EXTRA_CONF": json.dumps({**TEST_PROFILE_CONF, "spark.jars.ivySettings": str(unreachable)}),
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    stages = [line.split("] ", 1)[1] for line in result.stdout.splitlines() if line.startswith("[")]
    assert stages[2].startswith("Spark ") and stages[2].endswith(" started: master local[1], 3 shuffle partitions")
    assert "movements: rebuild" in result.stdout  # no tables yet: the update rebuilt them
    startup = (tmp_path / "startup.log").read_text()
    for ivy in (":: resolving dependencies", "resolution report", "retrieving ::"):
        assert ivy not in result.stdout and ivy not in result.stderr and ivy not in startup
    assert "replaced a previously registered data source" not in result.stderr  # registered once
    # Routine messages of Spark and py4j stay off the terminal: the plan-text hint, py4j's connection closing.
    for noise in ("Truncated the string representation of a plan", "Closing down clientserver connection",
                  "Traceback"):
        assert noise not in result.stderr, result.stderr[-3000:]
    assert cached_delta_jars(jars_cache_folder(cache, DELTA_MAVEN_VERSION), delta_coordinate(DELTA_MAVEN_VERSION))

"""Delta jars: coordinates, offline folders, and diagnosis of JVM start-up failures."""

from __future__ import annotations

import json
import zipfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pyspark
import pytest
from pyspark.sql import SparkSession

from spark_projections.cli import main
from spark_projections.errors import DeltaJarsUnavailableError, SparkStartupError
from spark_projections.jars import (
    delta_coordinate,
    diagnose_launch_failure,
    export_delta_jars,
    offline_delta_jars,
    spark_minor_version,
)
from spark_projections.settings import DELTA_MAVEN_VERSION, TEST_PROFILE_CONF


def test_pinned_jar_version_matches_the_installed_packages() -> None:
    # The jar is pinned (the wheel's own version has no jar on Maven Central); it must stay
    # on the wheel's major.minor and be built for the installed Spark.
    wheel = version("delta-spark")
    assert DELTA_MAVEN_VERSION.split(".")[:2] == wheel.split(".")[:2]
    spark_mm = ".".join(pyspark.__version__.split(".")[:2])
    assert spark_minor_version() == spark_mm
    assert delta_coordinate(DELTA_MAVEN_VERSION) == f"io.delta:delta-spark_{spark_mm}_2.13:{DELTA_MAVEN_VERSION}"


def make_jar(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_offline_folder_problems_are_told_apart(tmp_path: Path) -> None:
    with pytest.raises(DeltaJarsUnavailableError) as missing_dir:
        offline_delta_jars(tmp_path / "absent")
    assert missing_dir.value.problem == "offline_dir_missing"

    folder = tmp_path / "jars"
    folder.mkdir()
    make_jar(folder / "io.delta_delta-storage-4.4.0.jar", {"io/delta/storage/LogStore.class": b""})
    with pytest.raises(DeltaJarsUnavailableError) as missing_jar:
        offline_delta_jars(folder)
    assert missing_jar.value.problem == "offline_jars_missing"
    assert "delta-spark" in str(missing_jar.value) and "fetch-delta-jars" in str(missing_jar.value)

    other_spark = make_jar(
        folder / "io.delta_delta-spark_3.5_2.13-4.4.0.jar",
        {"io/delta/sql/DeltaSparkSessionExtension.class": b""},
    )
    with pytest.raises(DeltaJarsUnavailableError) as wrong_spark:
        offline_delta_jars(folder)
    assert wrong_spark.value.problem == "offline_jars_incompatible"
    assert "Spark 3.5" in str(wrong_spark.value)
    other_spark.unlink()

    (folder / f"delta-spark_{spark_minor_version()}_2.13-4.4.0.jar").write_bytes(b"not a zip")
    with pytest.raises(DeltaJarsUnavailableError) as corrupt:
        offline_delta_jars(folder)
    assert corrupt.value.problem == "offline_jars_incompatible"


# What Spark printed (trimmed) when asked for io.delta:delta-spark_4.2_2.13:4.4.1 - the
# coordinate `configure_spark_with_delta_pip` derives from the 4.4.1 wheel - on a machine
# that reaches Maven Central but not Spark's community repository.
REAL_NOT_PUBLISHED_OUTPUT = """\
:: resolving dependencies :: org.apache.spark#spark-submit-parent-5c9c;1.0
You probably access the destination server through a proxy server that is not well configured.
:::: WARNINGS
\tHost repos.spark-packages.org not found. url=https://repos.spark-packages.org/io/delta/delta-spark_4.2_2.13/4.4.1/delta-spark_4.2_2.13-4.4.1.pom
\t\tmodule not found: io.delta#delta-spark_4.2_2.13;4.4.1
\t\t:: io.delta#delta-spark_4.2_2.13;4.4.1: not found
Exception in thread "main" java.lang.RuntimeException: [unresolved dependency: io.delta#delta-spark_4.2_2.13;4.4.1: not found]
\tat org.apache.spark.util.MavenUtils$.resolveMavenCoordinates(MavenUtils.scala:539)
"""


def test_diagnosis_of_an_unpublished_version() -> None:
    error = diagnose_launch_failure(REAL_NOT_PUBLISHED_OUTPUT, coordinate="io.delta:delta-spark_4.2_2.13:4.4.1")
    assert isinstance(error, DeltaJarsUnavailableError)
    assert error.problem == "artifact_not_found"
    assert "JETSOURCING_SPARK_DELTA_VERSION" in str(error)
    # Spark's community repository being unreachable is not the story.
    assert error.jvm_output is not None and "spark-packages" not in error.jvm_output


def test_diagnosis_of_other_start_up_failures() -> None:
    output = "Error: Could not create the Java Virtual Machine.\nError: A fatal exception has occurred."
    error = diagnose_launch_failure(output, coordinate=None)
    assert isinstance(error, SparkStartupError)
    assert "Could not create the Java Virtual Machine" in str(error)


def test_real_jvm_resolution_failures_become_typed_errors(tmp_path: Path, run_python: Any) -> None:
    """Two real JVM launches whose Ivy repositories are local: one refuses connections
    (unreachable), one is an empty folder (not published). No network is involved."""
    empty_repo = tmp_path / "empty-repo"
    empty_repo.mkdir()
    settings_files = {}
    for name, root in (("unreachable", "http://127.0.0.1:9/maven2/"), ("empty", empty_repo.as_uri() + "/")):
        xml = tmp_path / f"{name}.xml"
        xml.write_text(
            '<ivysettings><settings defaultResolver="main"/><resolvers><chain name="main">'
            f'<ibiblio name="{name}" m2compatible="true" root="{root}"/>'
            "</chain></resolvers></ivysettings>"
        )
        settings_files[name] = str(xml)
    code = f"""
import json
from pyspark import SparkContext
from spark_projections.session import spark_session, SparkSettings
from spark_projections.errors import DeltaJarsUnavailableError
out = {{}}
for name, xml in {json.dumps(settings_files)}.items():
    conf = {{"spark.jars.ivySettings": xml, "spark.jars.ivy": {json.dumps(str(tmp_path / "ivy"))}}}
    try:
        spark_session(SparkSettings.test_profile(
            delta_jars_dir=None, delta_jars_cache={json.dumps(str(tmp_path / "cache"))}, extra_conf=conf
        ))
        out[name] = "started"
    except DeltaJarsUnavailableError as e:
        out[name] = [e.problem, str(e), SparkContext._gateway is None]
print("RESULT" + json.dumps(out))
"""
    result = run_python(code, timeout=120)
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, result.stdout + result.stderr[-3000:]
    out = json.loads(line[len("RESULT"):])
    problem, message, no_jvm_left = out["unreachable"]
    assert problem == "maven_unreachable" and no_jvm_left
    assert "127.0.0.1:9" in message and "Connection refused" in message
    problem, message, _ = out["empty"]
    assert problem == "artifact_not_found"
    assert f"io.delta#delta-spark_{spark_minor_version()}_2.13;{DELTA_MAVEN_VERSION}" in message
    # Ivy's report stays out of the terminal: it is in the start-up log, which the message names.
    assert "UNRESOLVED DEPENDENCIES" not in result.stderr
    log = Path(message.rsplit("The JVM's whole start-up output is in ", 1)[1].rstrip(".)"))
    assert "UNRESOLVED DEPENDENCIES" in log.read_text()


def test_export_jars_then_run_offline(
    spark: SparkSession, tmp_path: Path, run_python: Any, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`fetch-delta-jars` copies the resolved jars; a fresh process then runs offline on them."""
    jars = tmp_path / "delta-jars"
    # The CLI builds settings from the environment; keep the shared session's test values.
    monkeypatch.setenv("JETSOURCING_SPARK_SHUFFLE_PARTITIONS", "2")
    monkeypatch.setenv("JETSOURCING_SPARK_LOG_LEVEL", "ERROR")
    assert main(["fetch-delta-jars", str(jars)]) == 0
    assert f"JETSOURCING_SPARK_DELTA_JARS_DIR={jars.resolve()}" in capsys.readouterr().out
    copied = offline_delta_jars(jars)
    resolved = spark.sparkContext.getConf().get("spark.jars") or ""
    assert sorted(p.name for p in copied) == sorted(Path(e).name for e in resolved.split(","))

    unreachable = tmp_path / "unreachable.xml"
    unreachable.write_text(
        '<ivysettings><settings defaultResolver="main"/><resolvers><chain name="main">'
        '<ibiblio name="unreachable" m2compatible="true" root="http://127.0.0.1:9/maven2/"/>'
        "</chain></resolvers></ivysettings>"
    )
    result = run_python(
        "import sys\nfrom spark_projections.cli import main\nsys.exit(main(['check']))\n",
        env={
            "JETSOURCING_SPARK_DELTA_JARS_DIR": str(jars),
            "JETSOURCING_SPARK_MASTER": "local[1]",
            "JETSOURCING_SPARK_SHUFFLE_PARTITIONS": "1",
            "JETSOURCING_SPARK_STARTUP_LOG": str(tmp_path / "logs" / "startup.log"),
            # Proof that nothing is downloaded: Ivy's only repository refuses connections.
            "JETSOURCING_SPARK_EXTRA_CONF": json.dumps(
                {**TEST_PROFILE_CONF, "spark.jars.ivySettings": str(unreachable)}
            ),
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"delta jars: offline from {jars}" in result.stdout
    assert "delta round trip (write a table, read it back): ok in " in result.stdout
    assert "resolving dependencies" not in result.stderr
    assert (tmp_path / "logs" / "startup.log").is_file()  # the JVM's start-up output went there


def test_cli_reports_errors_without_a_traceback(tmp_path: Path, run_python: Any) -> None:
    # A fresh interpreter: the jars settings only matter to a call that starts the JVM.
    result = run_python(
        "import sys\nfrom spark_projections.cli import main\nsys.exit(main(['check']))\n",
        env={"JETSOURCING_SPARK_DELTA_JARS_DIR": str(tmp_path / "missing")},
    )
    assert result.returncode == 1  # a failure it explains; 2 is for usage errors
    assert result.stderr.startswith("jetsourcing: The offline Delta jars folder"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_two_processes_starting_together_on_an_empty_cache_resolve_once_and_both_start(tmp_path: Path) -> None:
    # Two `jetsourcing spark check` at the same time, each a fresh JVM, on an empty Ivy directory and jars cache:
    # they really download (from Maven Central). Ivy does not lock its cache: together, one once read the other's
    # half-written jar ("Downloaded file size (0) doesn't match expected Content Length") and did not start.
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_GATEWAY", "JETSOURCING_"))}
    env.update({
        "PYTHONPATH": str(root),
        "JETSOURCING_SPARK_MASTER": "local[1]",
        "JETSOURCING_SPARK_DELTA_JARS_CACHE": str(tmp_path / "cache"),
        "JETSOURCING_SPARK_EXTRA_CONF": json.dumps({**TEST_PROFILE_CONF, "spark.jars.ivy": str(tmp_path / "ivy")}),
    })
    processes = [
        subprocess.Popen([sys.executable, "-m", "projections.cli", "spark", "check"], cwd=root, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        results = [(p.communicate(timeout=900), p.returncode) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    for (out, err), code in results:
        assert code == 0 and "delta round trip (write a table, read it back): ok" in out, out + err[-3000:]
    outs = sorted(out for (out, _), _ in results)
    through_ivy = [out for out in outs if "(Maven, through Ivy)" in out]
    from_cache = [out for out in outs if "(from the jars cache: " in out]
    assert len(through_ivy) == 1 and len(from_cache) == 1, outs  # the second waited, then took what the first stored
    waited = [err for (_, err), _ in results if f"is resolving jars in {tmp_path / 'ivy'}" in err]
    assert len(waited) == 1, [err[-2000:] for (_, err), _ in results]


def test_the_demo_states_the_size_of_what_a_first_start_downloads(spark: SparkSession) -> None:
    from samples.spark_demo import DELTA_JARS_MB
    from spark_projections.jars import session_jars

    downloaded_mb = sum(jar.stat().st_size for jar in session_jars(spark)) / 1e6
    assert abs(downloaded_mb - DELTA_JARS_MB) <= 0.1 * downloaded_mb, f"the jars are {downloaded_mb:.0f} MB"


def test_a_resolution_waits_for_the_one_under_way_and_gives_up_at_its_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import fcntl
    import os

    from spark_projections.jars_lock import LOCK_FILE, resolution_lock

    with resolution_lock(tmp_path / "ivy") as first:
        assert first.waited_s < 1
        other = os.open(tmp_path / "ivy" / LOCK_FILE, os.O_RDWR)  # another open file: as another process's
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(DeltaJarsUnavailableError) as refused, resolution_lock(tmp_path / "ivy", timeout_s=0.5):
                pass
        finally:
            os.close(other)
    assert refused.value.problem == "resolution_busy"
    assert f"(pid {os.getpid()}) has been resolving jars in {tmp_path / 'ivy'}" in str(refused.value)
    assert f"Another process (pid {os.getpid()}) is resolving jars in {tmp_path / 'ivy'}" in caplog.text
    with resolution_lock(tmp_path / "ivy", timeout_s=0.5) as again:  # released by the first holder
        assert again.waited_s < 0.5

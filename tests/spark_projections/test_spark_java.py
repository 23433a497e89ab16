"""The Java check that runs before Spark starts a JVM (fake runtimes exercise our parser)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from spark_projections.errors import JavaNotFoundError, JavaTooOldError
from spark_projections.java import MIN_JAVA_MAJOR, check_java, find_java, parse_java_version


def fake_java_home(root: Path, version_output: str, *, exit_code: int = 0) -> Path:
    """A JAVA_HOME whose bin/java prints ``version_output`` to stderr like a real one."""
    java = root / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text(f"#!/bin/sh\ncat >&2 <<'OUT'\n{version_output}\nOUT\nexit {exit_code}\n")
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    return root


@pytest.mark.parametrize(
    ("output", "version", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime Environment', "17.0.15", 17),
        ('java version "1.8.0_292"\nJava(TM) SE Runtime Environment', "1.8.0_292", 8),
        ('openjdk version "21" 2023-09-19', "21", 21),
        ('openjdk version "11.0.2" 2019-01-15', "11.0.2", 11),
        ('Picked up JAVA_TOOL_OPTIONS: -Xmx1g\nopenjdk version "22-ea" 2024-03-19', "22-ea", 22),
    ],
)
def test_parse_java_version(output: str, version: str, major: int) -> None:
    assert parse_java_version(output) == (version, major)


def test_parse_java_version_rejects_output_without_version() -> None:
    with pytest.raises(ValueError):
        parse_java_version("command not found")


def test_the_real_java_on_this_machine_passes() -> None:
    runtime = check_java()
    assert runtime.major >= MIN_JAVA_MAJOR
    assert runtime.executable.is_file()


def test_old_java_from_java_home_is_refused(tmp_path: Path) -> None:
    home = fake_java_home(tmp_path / "jdk8", 'java version "1.8.0_292"\nJava(TM) SE Runtime')
    with pytest.raises(JavaTooOldError) as caught:
        check_java({"JAVA_HOME": str(home), "PATH": os.environ["PATH"]})
    error = caught.value
    assert (error.major, error.version, error.java) == (8, "1.8.0_292", home / "bin" / "java")
    assert "Java 17 or newer" in str(error) and "JAVA_HOME" in str(error)


def test_java_home_without_java_is_reported_not_bypassed(tmp_path: Path) -> None:
    # Spark would use the broken JAVA_HOME, so we must not fall back to PATH's java.
    (tmp_path / "empty-jdk").mkdir()
    with pytest.raises(JavaNotFoundError) as caught:
        find_java({"JAVA_HOME": str(tmp_path / "empty-jdk"), "PATH": os.environ["PATH"]})
    assert "empty-jdk" in str(caught.value) and "bin/java" in str(caught.value)


def test_no_java_home_and_no_java_on_path(tmp_path: Path) -> None:
    with pytest.raises(JavaNotFoundError) as caught:
        check_java({"PATH": str(tmp_path)})
    assert "no `java` on PATH" in str(caught.value)


def test_java_that_fails_or_prints_no_version(tmp_path: Path) -> None:
    broken = fake_java_home(tmp_path / "broken", "Error: could not open libjvm.so", exit_code=1)
    with pytest.raises(JavaNotFoundError) as caught:
        check_java({"JAVA_HOME": str(broken), "PATH": os.environ["PATH"]})
    assert "libjvm.so" in str(caught.value)
    garbled = fake_java_home(tmp_path / "garbled", "hello")
    with pytest.raises(JavaNotFoundError):
        check_java({"JAVA_HOME": str(garbled), "PATH": os.environ["PATH"]})


def test_spark_session_refuses_old_java_before_starting_a_jvm(
    tmp_path: Path, run_python: Any
) -> None:
    home = fake_java_home(tmp_path / "jdk11", 'openjdk version "11.0.2" 2019-01-15')
    result = run_python(
        "from spark_projections.session import spark_session, SparkSettings\n"
        "from spark_projections.errors import JavaTooOldError\n"
        "from pyspark import SparkContext\n"
        "try:\n"
        "    spark_session(SparkSettings.test_profile())\n"
        "except JavaTooOldError as e:\n"
        "    print('REFUSED', e.major, SparkContext._gateway is None)\n",
        env={"JAVA_HOME": str(home)},
        timeout=60,
    )
    assert result.stdout.strip() == "REFUSED 11 True", result.stderr

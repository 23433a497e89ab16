"""jetsourcing's cache of the Delta jars: verified on every use, published atomically, refilled from Maven when
damaged, and enough for a JVM to start without Ivy."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyspark
import pytest
from pyspark.sql import SparkSession

from spark_projections.jars import (
    CACHE_MANIFEST,
    cached_delta_jars,
    delta_coordinate,
    jars_cache_folder,
    session_jars,
    store_delta_jars,
)
from spark_projections.session import build_conf
from spark_projections.settings import DELTA_MAVEN_VERSION, SparkSettings, default_delta_jars_cache

COORDINATE = delta_coordinate(DELTA_MAVEN_VERSION)


@pytest.fixture
def sources(spark: SparkSession) -> list[Path]:
    """The Delta jars of the shared session (resolved by Ivy, or taken from the user's cache)."""
    return session_jars(spark)


def leftovers(cache: Path) -> list[str]:
    """Anything in ``cache`` besides published folders: staging copies, folders moved aside."""
    return sorted(p.name for p in cache.iterdir() if p.name.startswith("."))


def test_the_cache_folder_follows_xdg_and_the_versions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_delta_jars_cache() == tmp_path / "jetsourcing" / "delta-jars"
    assert SparkSettings().delta_jars_cache == tmp_path / "jetsourcing" / "delta-jars"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG specification says: ignore it
    assert default_delta_jars_cache() == Path.home() / ".cache" / "jetsourcing" / "delta-jars"
    monkeypatch.setenv("JETSOURCING_SPARK_DELTA_JARS_CACHE", str(tmp_path / "mine"))
    assert SparkSettings().delta_jars_cache == tmp_path / "mine"
    monkeypatch.setenv("JETSOURCING_SPARK_DELTA_JARS_CACHE", "")  # empty: no cache (not the current directory)
    assert SparkSettings().delta_jars_cache is None
    conf = build_conf(SparkSettings.test_profile(delta_jars_dir=None))
    assert conf["spark.jars.packages"] == COORDINATE and "spark.jars" not in conf
    assert jars_cache_folder(tmp_path, "4.4.0") == tmp_path / f"4.4.0-spark{pyspark.__version__}"


def test_a_stored_folder_verifies_and_build_conf_starts_from_it(sources: list[Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = jars_cache_folder(cache, DELTA_MAVEN_VERSION)
    published = store_delta_jars(sources, folder, COORDINATE)
    assert [p.name for p in published] == [p.name for p in sources]  # the classpath's order is kept
    assert cached_delta_jars(folder, COORDINATE) == published
    assert leftovers(cache) == []

    conf = build_conf(SparkSettings.test_profile(delta_jars_dir=None, delta_jars_cache=cache))
    assert "spark.jars.packages" not in conf  # Ivy has nothing to do
    assert conf["spark.jars"] == ",".join(p.resolve().as_uri() for p in published)
    # Jars or packages of the user's own: resolved together through Ivy, as before the cache existed.
    extra = build_conf(SparkSettings.test_profile(
        delta_jars_dir=None, delta_jars_cache=cache, extra_conf={"spark.jars.packages": "org.example:x:1.0"}
    ))
    assert extra["spark.jars.packages"] == f"{COORDINATE},org.example:x:1.0" and "spark.jars" not in extra
    # Another Delta version has a folder of its own.
    other = build_conf(SparkSettings.test_profile(delta_jars_dir=None, delta_jars_cache=cache, delta_version="9.9.9"))
    assert other["spark.jars.packages"] == delta_coordinate("9.9.9")


def truncate(jar: Path) -> None:
    with open(jar, "r+b") as file:
        file.truncate(jar.stat().st_size // 2)


def flip_a_byte(jar: Path) -> None:
    with open(jar, "r+b") as file:
        file.seek(jar.stat().st_size // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))


def rewrite_manifest(change: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        manifest = json.loads((folder / CACHE_MANIFEST).read_text())
        change(manifest)
        (folder / CACHE_MANIFEST).write_text(json.dumps(manifest))
    return damage


def storage_jar(folder: Path) -> Path:
    return next(folder.glob("*delta-storage-*.jar"))


DAMAGES: dict[str, Callable[[Path], None]] = {
    "a truncated jar": lambda folder: truncate(storage_jar(folder)),
    "a byte changed, same size": lambda folder: flip_a_byte(storage_jar(folder)),
    "a jar missing": lambda folder: storage_jar(folder).unlink(),
    "an unreadable manifest": lambda folder: (folder / CACHE_MANIFEST).write_text("{not json"),
    "a manifest of another Delta": rewrite_manifest(lambda m: m.update(coordinate=delta_coordinate("9.9.9"))),
    "a manifest of another PySpark": rewrite_manifest(lambda m: m.update(pyspark="3.5.0")),
    "a manifest naming a file elsewhere": rewrite_manifest(lambda m: m["jars"][0].update(name="../../etc.jar")),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_folder_is_refused_with_a_warning_then_replaced(
    damage: str, sources: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    folder = jars_cache_folder(cache, DELTA_MAVEN_VERSION)
    store_delta_jars(sources, folder, COORDINATE)
    DAMAGES[damage](folder)
    with caplog.at_level(logging.WARNING, logger="spark_projections.jars"):
        assert cached_delta_jars(folder, COORDINATE) is None
    assert f"The Delta jars cache {folder} is not usable (" in caplog.text
    # What a start through Maven does next: the broken folder makes way for a complete one.
    store_delta_jars(sources, folder, COORDINATE)
    assert cached_delta_jars(folder, COORDINATE) is not None
    assert leftovers(cache) == []


def test_a_folder_without_manifest_is_no_cache(sources: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "copied-by-hand"
    folder.mkdir()
    for jar in sources:
        (folder / jar.name).write_bytes(jar.read_bytes())
    with caplog.at_level(logging.WARNING):
        assert cached_delta_jars(folder, COORDINATE) is None
    assert caplog.text == ""  # nothing wrong: there is just no cache yet


def test_concurrent_first_stores_leave_one_complete_folder(
    sources: list[Path], tmp_path: Path, run_python: Any
) -> None:
    """Writers in separate processes, with a reader verifying all along; first into no folder, then over a
    broken one. The reader never meets a partial folder, and nothing is left beside the published one."""
    cache = tmp_path / "cache"
    folder = jars_cache_folder(cache, DELTA_MAVEN_VERSION)
    writer = (
        "from pathlib import Path\n"
        "from spark_projections.jars import store_delta_jars\n"
        f"store_delta_jars([Path(p) for p in {[str(p) for p in sources]!r}], Path({str(folder)!r}), {COORDINATE!r})\n"
        "print('STORED')\n"
    )
    reader = (
        "import logging, time\n"
        "from pathlib import Path\n"
        "from spark_projections.jars import cached_delta_jars\n"
        "logging.basicConfig(level=logging.WARNING, format='WARNING %(message)s')\n"
        "seen = set()\n"
        "deadline = time.monotonic() + 60\n"
        "while time.monotonic() < deadline and 'complete' not in seen:\n"
        f"    jars = cached_delta_jars(Path({str(folder)!r}), {COORDINATE!r})\n"
        "    seen.add('none' if jars is None else 'complete')\n"
        "print('COMPLETE' if 'complete' in seen else 'NEVER COMPLETE')\n"
    )
    for start in ("no folder", "a broken folder"):
        if start == "a broken folder":
            truncate(storage_jar(folder))
        with ThreadPoolExecutor(5) as pool:
            runs = [pool.submit(run_python, code) for code in [writer] * 4 + [reader]]
            results = [run.result() for run in runs]
        for result in results[:4]:
            assert result.returncode == 0 and result.stdout == "STORED\n", result.stderr[-3000:]
        if start == "no folder":  # over a broken folder, the reader warns until a writer replaced it
            assert "WARNING" not in results[4].stderr, results[4].stderr
        assert results[4].stdout == "COMPLETE\n", results[4].stdout + results[4].stderr[-3000:]
        assert cached_delta_jars(folder, COORDINATE) is not None, start
        assert leftovers(cache) == [], start


def test_an_unwritable_cache_is_a_warning_not_an_error(
    sources: list[Path], tmp_path: Path, run_python: Any
) -> None:
    """A session whose jars Maven resolved, with a cache it cannot write: it starts, and says why the next start
    will resolve again. (A file where the cache's folder should be: refused even to root.)"""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    result = run_python(
        "from spark_projections.session import spark_session, SparkSettings\n"
        f"spark = spark_session(SparkSettings.test_profile(delta_jars_cache={str(blocker / 'cache')!r}))\n"
        "print('STARTED', spark.sparkContext.getConf().get('spark.jars.packages'))\n",
    )
    assert result.stdout == f"STARTED {COORDINATE}\n", result.stdout + result.stderr[-3000:]
    assert "The Delta jars could not be stored in the cache" in result.stderr
    assert "JETSOURCING_SPARK_DELTA_JARS_CACHE" in result.stderr


def test_a_damaged_cache_falls_back_to_maven_and_is_rewritten(
    sources: list[Path], tmp_path: Path, run_python: Any
) -> None:
    """A real JVM start on a cache whose jar was truncated: it starts (Ivy resolves the jars), warns, and leaves
    a complete folder for the next start."""
    cache = tmp_path / "cache"
    folder = jars_cache_folder(cache, DELTA_MAVEN_VERSION)
    store_delta_jars(sources, folder, COORDINATE)
    truncate(storage_jar(folder))
    result = run_python(
        "from spark_projections.session import spark_session, SparkSettings\n"
        f"spark = spark_session(SparkSettings.test_profile(delta_jars_cache={str(cache)!r}))\n"
        "print('STARTED', spark.sparkContext.getConf().get('spark.jars.packages'))\n",
    )
    assert result.stdout == f"STARTED {COORDINATE}\n", result.stdout + result.stderr[-3000:]
    assert f"The Delta jars cache {folder} is not usable (" in result.stderr
    assert cached_delta_jars(folder, COORDINATE) is not None
    assert leftovers(cache) == []

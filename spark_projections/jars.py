"""Where the Delta Lake jars come from: Maven coordinates, offline folders, diagnosis.

Online mode asks Spark to resolve :func:`delta_coordinate` from Maven Central (Spark's
Ivy caches it under ``~/.ivy2.5.2``). Offline mode points ``spark.jars`` at a folder
prepared beforehand by :func:`export_delta_jars` (CLI: ``jetsourcing spark
fetch-delta-jars DIR``) and validated by :func:`offline_delta_jars`.
:func:`diagnose_launch_failure` turns what the JVM printed when it died during start-up
into a typed error.
"""

from __future__ import annotations

import re
import shutil
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyspark
from pyspark.sql import SparkSession

from spark_projections.errors import (
    DeltaJarsUnavailableError,
    SparkProjectionError,
    SparkStartupError,
)

__all__ = [
    "SCALA_BINARY_VERSION",
    "delta_coordinate",
    "diagnose_launch_failure",
    "export_delta_jars",
    "offline_delta_jars",
    "spark_minor_version",
]

SCALA_BINARY_VERSION = "2.13"
"""Spark 4 is built for Scala 2.13 only."""

# Ivy names retrieved jars `<org>_<artifact>-<version>.jar`; Maven names them
# `<artifact>-<version>.jar`. Both forms are accepted.
_DELTA_SPARK_RE = re.compile(r"delta-spark_(?P<spark>\d+\.\d+)_(?P<scala>\d+\.\d+)-(?P<version>[^/]+)\.jar$")
_DELTA_STORAGE_RE = re.compile(r"delta-storage-(?P<version>[^/]+)\.jar$")
# A class that exists only in a real delta-spark jar and is what the session extension loads.
_DELTA_EXTENSION_CLASS = "io/delta/sql/DeltaSparkSessionExtension.class"


def spark_minor_version() -> str:
    """The installed PySpark's ``major.minor`` (e.g. ``"4.2"``): the Delta artifact suffix."""
    return ".".join(pyspark.__version__.split(".")[:2])


def delta_coordinate(delta_version: str) -> str:
    """Maven coordinate of the Delta jar built for the installed Spark, e.g.
    ``io.delta:delta-spark_4.2_2.13:4.4.0`` (same naming as ``configure_spark_with_delta_pip``)."""
    return f"io.delta:delta-spark_{spark_minor_version()}_{SCALA_BINARY_VERSION}:{delta_version}"


def offline_delta_jars(jars_dir: Path) -> list[Path]:
    """Validate an offline jars folder and return every jar in it, sorted.

    Guarantees on return: the folder holds a readable ``delta-spark`` jar built for the
    installed Spark (containing Delta's session extension) and a ``delta-storage`` jar.
    Raises :class:`DeltaJarsUnavailableError` (``offline_dir_missing``,
    ``offline_jars_missing`` or ``offline_jars_incompatible``) otherwise, with what to do.
    """
    prepare = (
        "Prepare the folder on a machine that reaches Maven Central with "
        f"`jetsourcing spark fetch-delta-jars {jars_dir}` and copy it here, or unset "
        "JETSOURCING_SPARK_DELTA_JARS_DIR to download the jars at start-up."
    )
    if not jars_dir.is_dir():
        raise DeltaJarsUnavailableError(
            "offline_dir_missing",
            f"The offline Delta jars folder {jars_dir} does not exist. {prepare}",
            jars_dir=jars_dir,
        )
    jars = sorted(p for p in jars_dir.iterdir() if p.is_file() and p.suffix == ".jar")
    spark_jars = [p for p in jars if _DELTA_SPARK_RE.search(p.name)]
    storage_jars = [p for p in jars if _DELTA_STORAGE_RE.search(p.name)]
    missing = [
        name
        for name, found in (("delta-spark", spark_jars), ("delta-storage", storage_jars))
        if not found
    ]
    if missing:
        raise DeltaJarsUnavailableError(
            "offline_jars_missing",
            f"The offline Delta jars folder {jars_dir} has no {' or '.join(missing)} jar "
            f"({len(jars)} jar(s) found). {prepare}",
            jars_dir=jars_dir,
        )
    wanted = spark_minor_version()
    for jar in spark_jars:
        match = _DELTA_SPARK_RE.search(jar.name)
        assert match is not None  # filtered above
        if match.group("spark") != wanted or match.group("scala") != SCALA_BINARY_VERSION:
            raise DeltaJarsUnavailableError(
                "offline_jars_incompatible",
                f"{jar.name} in {jars_dir} is built for Spark {match.group('spark')} / Scala "
                f"{match.group('scala')}, but this environment runs PySpark "
                f"{pyspark.__version__} (needs delta-spark_{wanted}_{SCALA_BINARY_VERSION}). "
                f"{prepare}",
                jars_dir=jars_dir,
            )
        if not _jar_has(jar, _DELTA_EXTENSION_CLASS):
            raise DeltaJarsUnavailableError(
                "offline_jars_incompatible",
                f"{jar} is not a usable delta-spark jar (unreadable, or without "
                f"{_DELTA_EXTENSION_CLASS}). {prepare}",
                jars_dir=jars_dir,
            )
    return jars


def _jar_has(jar: Path, member: str) -> bool:
    """Whether ``jar`` is a readable zip archive containing ``member``."""
    try:
        with zipfile.ZipFile(jar) as archive:
            archive.getinfo(member)
    except (OSError, zipfile.BadZipFile, KeyError):
        return False
    return True


def export_delta_jars(spark: SparkSession, dest: Path) -> list[Path]:
    """Copy the jars this session resolved (its ``spark.jars``) into ``dest``.

    Run it with an online-mode session (which resolved the Delta coordinate and its
    dependencies through Ivy): ``dest`` then holds exactly the classpath additions that
    session used, and works as ``delta_jars_dir`` on a machine without network. Returns
    the copied files; ``dest`` is created if needed. Raises :class:`SparkProjectionError`
    when the session has no local jars to copy.
    """
    listed = spark.sparkContext.getConf().get("spark.jars") or ""
    sources = [_local_path(entry) for entry in listed.split(",") if entry.strip()]
    if not sources:
        raise SparkProjectionError(
            "This Spark session has no resolved jars (spark.jars is empty), so there is "
            "nothing to export. Create the session in online mode (no delta_jars_dir) first."
        )
    dest.mkdir(parents=True, exist_ok=True)
    copied: list[Path] = []
    for source in sources:
        target = dest / source.name
        if source.resolve() != target.resolve():
            shutil.copy2(source, target)
        copied.append(target)
    return copied


def _local_path(entry: str) -> Path:
    """A ``spark.jars`` entry (``file:`` URI or plain path) as a local path."""
    entry = entry.strip()
    parsed = urlparse(entry)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme in ("", "local"):
        return Path(unquote(parsed.path) if parsed.scheme else entry)
    raise SparkProjectionError(
        f"spark.jars entry {entry!r} is not a local file; only local jars can be exported."
    )


# What Ivy prints when a repository cannot be contacted at all (as opposed to answering
# "not found"). Examples:
#   Server access error at url http://host/x.pom (java.net.ConnectException: Connection refused)
#   Host repo.example.org not found. url=https://repo.example.org/x.pom
_SERVER_ACCESS_RE = re.compile(r"Server access error at url (?P<url>\S+)")
_HOST_NOT_FOUND_RE = re.compile(r"Host (?P<host>\S+) not found\. url=")
_UNRESOLVED_RE = re.compile(r"unresolved dependency: (?P<module>[^:\]]+): not found")
# Spark always adds its own community repository to the search; whether it is reachable
# says nothing about Maven Central, which is where Delta is published.
_IGNORED_REPOSITORY = "spark-packages"


def diagnose_launch_failure(output: str, *, coordinate: str | None) -> SparkProjectionError:
    """Turn the JVM's start-up output (it died before PySpark could connect) into an error.

    Returns (does not raise) a :class:`DeltaJarsUnavailableError` when Ivy could not
    resolve a dependency - ``maven_unreachable`` if some repository could not be
    contacted, ``artifact_not_found`` if they answered without it - and a
    :class:`SparkStartupError` with the last lines of output for anything else.
    """
    unresolved = _UNRESOLVED_RE.findall(output)
    if unresolved:
        hosts: set[str] = set()
        for match in _SERVER_ACCESS_RE.finditer(output):
            hosts.add(urlparse(match.group("url")).netloc or match.group("url"))
        hosts.update(m.group("host") for m in _HOST_NOT_FOUND_RE.finditer(output))
        hosts = {h for h in hosts if _IGNORED_REPOSITORY not in h}
        evidence = _relevant_lines(output)
        modules = ", ".join(sorted(set(unresolved)))
        offline_hint = (
            "To run without network access, prepare a jars folder on a machine that has "
            "it (`jetsourcing spark fetch-delta-jars DIR`), copy it here and set "
            "JETSOURCING_SPARK_DELTA_JARS_DIR=DIR."
        )
        if hosts:
            return DeltaJarsUnavailableError(
                "maven_unreachable",
                f"Spark could not download {modules}: the Maven repository could not be "
                f"reached ({', '.join(sorted(hosts))}). Check network and proxy access to "
                f"Maven Central. {offline_hint}",
                coordinate=coordinate,
                jvm_output=evidence,
            )
        return DeltaJarsUnavailableError(
            "artifact_not_found",
            f"Spark could not resolve {modules}: the repositories answered but do not have "
            f"it, so this version is not published for Spark {spark_minor_version()}. Set "
            "JETSOURCING_SPARK_DELTA_VERSION (SparkSettings.delta_version) to a published "
            f"version of io.delta:delta-spark_{spark_minor_version()}_{SCALA_BINARY_VERSION}.",
            coordinate=coordinate,
            jvm_output=evidence,
        )
    # Stack frames name no cause; the exception lines above them do.
    lines = [
        line for line in output.splitlines() if line.strip() and not line.strip().startswith("at ")
    ]
    cause = next(
        (line.strip() for line in lines if "Exception" in line or "Error:" in line),
        "no error message was printed",
    )
    return SparkStartupError(
        f"The Spark JVM exited during start-up: {cause}", jvm_output="\n".join(lines[-25:])
    )


def _relevant_lines(output: str, limit: int = 15) -> str:
    """The lines of Ivy's report that explain a resolution failure, de-duplicated."""
    keep: list[str] = []
    for line in output.splitlines():
        text = line.strip()
        if not text or text in keep or _IGNORED_REPOSITORY in text:
            continue
        if (
            "unresolved dependency" in text
            or "Server access error" in text
            or _HOST_NOT_FOUND_RE.search(text)
            or "module not found" in text
        ):
            keep.append(text)
    return "\n".join(keep[:limit])

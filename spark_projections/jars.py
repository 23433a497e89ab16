"""Where the Delta Lake jars come from: Maven coordinates, offline folders, jetsourcing's cache, diagnosis.

Online mode asks Spark to resolve :func:`delta_coordinate` from Maven Central (Spark's
Ivy caches it under ``~/.ivy2.5.2``). Even with Ivy's cache warm that costs over a
second of the JVM's CPU and a long report at every start, so after a first resolution
the jars are kept in a cache folder of jetsourcing's (:func:`store_delta_jars`) and
later starts take them from there (:func:`cached_delta_jars`, verified against the
SHA-256 of each jar) without running Ivy. Offline mode points ``spark.jars`` at a folder prepared beforehand by
:func:`export_delta_jars` (CLI: ``jetsourcing spark fetch-delta-jars DIR``) and validated
by :func:`offline_delta_jars`. :func:`diagnose_launch_failure` turns what the JVM printed
when it died during start-up into a typed error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
import zipfile
from collections.abc import Sequence
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
    "CACHE_MANIFEST",
    "SCALA_BINARY_VERSION",
    "cached_delta_jars",
    "check_listed_jars",
    "delta_coordinate",
    "diagnose_launch_failure",
    "export_delta_jars",
    "jars_cache_folder",
    "offline_delta_jars",
    "session_jars",
    "spark_minor_version",
    "store_delta_jars",
]

logger = logging.getLogger(__name__)

SCALA_BINARY_VERSION = "2.13"
"""Spark 4 is built for Scala 2.13 only."""

CACHE_MANIFEST = "jetsourcing-jars.json"
"""The file of a jars cache folder that lists its jars with their sizes and SHA-256 (see :func:`store_delta_jars`)."""

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


def session_jars(spark: SparkSession) -> list[Path]:
    """The local jars on this session's classpath besides Spark's own (its ``spark.jars``), in order.

    Raises :class:`SparkProjectionError` when it has none, or one that is not a local file.
    """
    listed = spark.sparkContext.getConf().get("spark.jars") or ""
    jars = [_local_path(entry) for entry in listed.split(",") if entry.strip()]
    if not jars:
        raise SparkProjectionError(
            "This Spark session has no resolved jars (spark.jars is empty), so there is "
            "nothing to export. Create the session in online mode (no delta_jars_dir) first."
        )
    return jars


def check_listed_jars(listed: str) -> list[Path]:
    """Check the jars a ``spark.jars`` value lists before a JVM starts with them; return its ``local:`` ones.

    Spark only logs an error for a listed jar it cannot find and goes on
    without it, so a wrong path surfaces later as Delta's classes missing. Every
    entry that names a file on this machine (a plain path, ``file:`` or
    ``local:``) must exist here: :class:`DeltaJarsUnavailableError`
    (``jar_missing``). Spark hands the executors every listed jar except the
    ``local:`` ones, which each executor reads from its own disk: those are
    returned, for :func:`~spark_projections.executors.check_executor_jars`.
    Remote entries (``hdfs:``, ``https:``...) are left to Spark.
    """
    local: list[Path] = []
    for entry in (e.strip() for e in listed.split(",")):
        scheme = urlparse(entry).scheme
        if not entry or scheme not in ("", "file", "local"):
            continue
        path = _local_path(entry)
        if not path.is_file():
            raise DeltaJarsUnavailableError(
                "jar_missing",
                f"spark.jars lists {entry}, but there is no file at {path} on this machine (Spark would go on "
                "without it). Fix the path in JETSOURCING_SPARK_EXTRA_CONF or the offline jars folder, or remove it.",
            )
        if scheme == "local":
            local.append(path)
    return local


def export_delta_jars(spark: SparkSession, dest: Path) -> list[Path]:
    """Copy the jars this session resolved (its ``spark.jars``) into ``dest``.

    Run it with an online-mode session (which resolved the Delta coordinate and its
    dependencies through Ivy, or took them from the jars cache): ``dest`` then holds exactly
    the classpath additions that session used, and works as ``delta_jars_dir`` on a machine
    without network. Returns the copied files; ``dest`` is created if needed. Raises
    :class:`SparkProjectionError` when the session has no local jars to copy.
    """
    sources = session_jars(spark)
    dest.mkdir(parents=True, exist_ok=True)
    copied: list[Path] = []
    for source in sources:
        target = dest / source.name
        if source.resolve() != target.resolve():
            shutil.copy2(source, target)
        copied.append(target)
    return copied


def jars_cache_folder(cache: Path, delta_version: str) -> Path:
    """The folder of the jars cache ``cache`` for Delta ``delta_version`` on the installed PySpark:
    ``<cache>/<delta version>-spark<pyspark version>``."""
    return cache / f"{delta_version}-spark{pyspark.__version__}"


def cached_delta_jars(folder: Path, coordinate: str) -> list[Path] | None:
    """The jars of the cache folder ``folder`` written by :func:`store_delta_jars` for ``coordinate``, or ``None``.

    Guarantees on a list: the folder's manifest was written for ``coordinate`` and the installed
    PySpark, every jar it lists is there with the size and SHA-256 it was written with, and they
    pass :func:`offline_delta_jars`'s checks. ``None`` when there is no such folder, and, with a
    warning in the log saying why, when it fails any of these checks (a partial or changed copy):
    the caller then resolves the jars through Maven. Never raises.
    """
    if not (folder / CACHE_MANIFEST).is_file():
        return None
    try:
        return _verified(folder, coordinate)
    except _UnusableCache as exc:
        logger.warning("The Delta jars cache %s is not usable (%s): resolving the jars through Maven, which "
                       "rewrites it.", folder, exc)
        return None


class _UnusableCache(Exception):
    """What is wrong with a jars cache folder."""


def _verified(folder: Path, coordinate: str) -> list[Path]:
    """The jars of the cache folder ``folder``, checked as :func:`cached_delta_jars` says; ``_UnusableCache`` if not."""
    try:
        manifest = json.loads((folder / CACHE_MANIFEST).read_text(encoding="utf-8"))
        written_for = (manifest["coordinate"], manifest["pyspark"])
        listed = [(str(jar["name"]), int(jar["size"]), str(jar["sha256"])) for jar in manifest["jars"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _UnusableCache(f"its {CACHE_MANIFEST} cannot be read: {exc}") from exc
    if written_for != (coordinate, pyspark.__version__):
        raise _UnusableCache(f"written for {written_for[0]} on PySpark {written_for[1]}")
    jars = []
    for name, size, sha256 in listed:
        if Path(name).name != name or not name.endswith(".jar"):
            raise _UnusableCache(f"its {CACHE_MANIFEST} names {name!r}, not a jar of the folder")
        jar = folder / name
        try:
            found = jar.stat().st_size
            with open(jar, "rb") as file:
                changed = found != size or hashlib.file_digest(file, "sha256").hexdigest() != sha256
        except OSError as exc:
            raise _UnusableCache(f"{name}: {exc.strerror or exc}") from exc
        if changed:
            raise _UnusableCache(f"{name} is not the file that was cached ({found} bytes, cached {size})")
        jars.append(jar)
    try:
        offline_delta_jars(folder)
    except DeltaJarsUnavailableError as exc:
        raise _UnusableCache(f"not usable as Delta jars: {exc.problem}") from exc
    return jars


def store_delta_jars(sources: Sequence[Path], folder: Path, coordinate: str) -> list[Path]:
    """Publish ``sources``, the jars resolved for ``coordinate``, as the jars cache folder ``folder``.

    The jars are copied, with their sizes and SHA-256 in :data:`CACHE_MANIFEST`, into a new folder
    next to ``folder``, checked as :func:`offline_delta_jars` checks a folder, and renamed into
    place: a reader sees no folder or a complete one, and processes publishing at the same time
    leave one complete folder. An existing ``folder`` is kept if it verifies (another process
    published it) and replaced otherwise. Returns the jars of the published folder. Raises
    ``OSError`` when the cache cannot be written and :class:`DeltaJarsUnavailableError` when
    ``sources`` are not usable Delta jars; no temporary folder is left behind either way.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        listed = []
        for source in sources:
            target = staging / source.name
            shutil.copyfile(source, target)
            with open(target, "rb") as file:
                digest = hashlib.file_digest(file, "sha256").hexdigest()
            listed.append({"name": target.name, "size": target.stat().st_size, "sha256": digest})
        offline_delta_jars(staging)
        manifest = {"coordinate": coordinate, "pyspark": pyspark.__version__, "jars": listed}
        (staging / CACHE_MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        # mkdtemp's folder is private to us; the cache is as readable as the folder it is in.
        staging.chmod(folder.parent.stat().st_mode & 0o777)
        _publish(staging, folder, coordinate)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [folder / str(jar["name"]) for jar in listed]


def _publish(staging: Path, folder: Path, coordinate: str) -> None:
    """Rename ``staging`` to ``folder``, unless a folder that verifies got there first."""
    try:
        os.rename(staging, folder)
        return
    except OSError:  # `folder` exists: published by another process meanwhile, or broken
        pass
    try:
        _verified(folder, coordinate)
        return
    except _UnusableCache:
        pass
    # Renamed aside first because a folder cannot be replaced by a rename while it has files.
    aside = folder.with_name(f".{folder.name}.{uuid.uuid4().hex}.broken")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:  # another process moved it aside already
        pass
    try:
        os.rename(staging, folder)
    except OSError:  # another process published its copy in between; it verified as ours did
        pass
    shutil.rmtree(aside, ignore_errors=True)


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

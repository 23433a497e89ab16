"""Create the Spark session batch projections run on, with Delta Lake guaranteed usable.

:func:`spark_session` is the one entry point. It checks Java before a JVM exists, puts
the Delta jars on the classpath (from an offline folder, jetsourcing's jars cache, or
resolved through Maven, which fills the cache), makes Python workers use this
interpreter, and verifies after start-up that Delta's classes really load. Start-up
failures surface as typed :mod:`spark_projections.errors` with the JVM's own
explanation, not as ``JAVA_GATEWAY_EXITED``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

from py4j.java_gateway import JavaClass
from py4j.protocol import Py4JError
from pyspark import SparkConf, SparkContext
from pyspark.errors import PySparkRuntimeError
from pyspark.java_gateway import launch_gateway
from pyspark.sql import SparkSession

from spark_projections.errors import DeltaNotConfiguredError, SparkProjectionError, SparkStartupError
from spark_projections.executors import check_executor_jars
from spark_projections.jars import (
    cached_delta_jars,
    check_listed_jars,
    delta_coordinate,
    diagnose_launch_failure,
    jars_cache_folder,
    offline_delta_jars,
    session_jars,
    store_delta_jars,
)
from spark_projections.jars_lock import ivy_directory, resolution_lock
from spark_projections.java import check_java
from spark_projections.settings import SparkSettings
from spark_projections.ship import SHIP_CODE_CONF
from spark_projections.source import register

__all__ = [
    "DELTA_CATALOG",
    "DELTA_EXTENSION",
    "SparkSettings",
    "build_conf",
    "ensure_delta",
    "jvm_process",
    "spark_session",
]

logger = logging.getLogger(__name__)

DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
"""Spark SQL extension that adds Delta's SQL syntax and analysis rules."""

DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
"""Session catalog implementation that makes ``USING delta`` tables work."""

_LIST_KEYS = {"spark.jars": ",", "spark.jars.packages": ",", "spark.sql.extensions": ","}
# With any of these in extra_conf, the Delta jars are not all the classpath gains, so jars
# resolved together with them are not what the cache holds, nor is the cache enough.
_RESOLUTION_KEYS = ("spark.jars", "spark.jars.packages", "spark.jars.excludes")


def build_conf(settings: SparkSettings) -> dict[str, str]:
    """The complete Spark configuration :func:`spark_session` starts a JVM with.

    Starts nothing, so it can be inspected without a JVM; it reads the jars: an offline jars
    folder (``delta_jars_dir``) is validated, raising
    :class:`~spark_projections.errors.DeltaJarsUnavailableError` when unusable; otherwise
    ``spark.jars`` lists the jars cache's folder for this Delta and Spark when it verifies
    (:func:`~spark_projections.jars.cached_delta_jars`), and ``spark.jars.packages`` names the
    Delta coordinate for Ivy to resolve when it does not. User ``extra_conf`` overrides
    everything, except that list valued keys (jars, packages, extensions) are merged with ours
    rather than replaced; with jars or packages of its own the cache is not used.
    """
    return _conf(settings, _jars_conf(settings))


def _jars_conf(settings: SparkSettings) -> dict[str, str]:
    """Where the Delta jars of a new JVM come from, as Spark configuration."""
    if settings.delta_jars_dir is not None:
        return {"spark.jars": _uris(offline_delta_jars(settings.delta_jars_dir))}
    coordinate = delta_coordinate(settings.delta_version)
    cache = _cache_folder(settings)
    cached = None if cache is None else cached_delta_jars(cache, coordinate)
    if cached is not None:
        return {"spark.jars": _uris(cached)}
    return {"spark.jars.packages": coordinate}


def _cache_folder(settings: SparkSettings) -> Path | None:
    """The jars cache folder these settings use, if any."""
    if settings.delta_jars_cache is None or any(key in settings.extra_conf for key in _RESOLUTION_KEYS):
        return None
    return jars_cache_folder(settings.delta_jars_cache, settings.delta_version)


def _uris(jars: list[Path]) -> str:
    return ",".join(jar.resolve().as_uri() for jar in jars)


def _conf(settings: SparkSettings, jars: dict[str, str]) -> dict[str, str]:
    """The session's configuration with ``jars``, then ``extra_conf`` applied."""
    conf: dict[str, str] = {
        "spark.master": settings.master,
        "spark.app.name": settings.app_name,
        "spark.sql.shuffle.partitions": str(settings.shuffle_partitions),
        "spark.ui.enabled": "true" if settings.ui_enabled else "false",
        # Without this interpreter, Python workers run whatever `python3` is first on PATH,
        # not this venv, and UDFs / Python data sources die with ModuleNotFoundError. These
        # confs cover spark-submit and cluster managers; for the local driver PySpark only
        # reads PYSPARK_PYTHON, see _use_python_workers().
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.sql.extensions": DELTA_EXTENSION,
        "spark.sql.catalog.spark_catalog": DELTA_CATALOG,
        SHIP_CODE_CONF: "true" if settings.ship_code else "false",
        # Spark keeps the classes it compiles for queries in a cache of 100, the least recently
        # used out first. A fold's rebuild and two updates compile some 140 (the fold, its checks,
        # Delta's MERGE and state queries), each pushing out the next one's, so every update
        # compiled all of its own again: 0.5 s of a one-event update, 1 s of a 10,000-event one.
        "spark.sql.codegen.cache.maxEntries": "1000",
    }
    if settings.master.startswith("local"):
        # Local mode never needs a routable address; binding to loopback avoids Spark
        # picking (and warning about) whatever interface the hostname resolves to.
        conf["spark.driver.host"] = "127.0.0.1"
        conf["spark.driver.bindAddress"] = "127.0.0.1"
        # Delta rebuilds table state from its log in 50 tasks by default, sized for
        # clusters; on one machine that is mostly task overhead.
        conf["spark.databricks.delta.snapshotPartitions"] = str(settings.shuffle_partitions)
    if settings.driver_memory is not None:
        conf["spark.driver.memory"] = settings.driver_memory
    conf.update(jars)
    for key, value in settings.extra_conf.items():
        separator = _LIST_KEYS.get(key)
        if separator is not None and key in conf:
            ours = conf[key].split(separator)
            theirs = [v for v in value.split(separator) if v and v not in ours]
            conf[key] = separator.join(ours + theirs)
        else:
            conf[key] = value
    return conf


def spark_session(settings: SparkSettings | None = None) -> SparkSession:
    """Return a Spark session in which Delta Lake works, creating it if needed.

    ``settings`` defaults to ``SparkSettings()`` (i.e. ``JETSOURCING_SPARK_*`` env vars).
    Guarantees on return: Delta's extension and catalog are configured and their classes
    load (checked with :func:`ensure_delta`), and ``spark.read.format("jetstream")`` works
    (the data source is registered in the returned session). Raises, before any JVM starts,
    :class:`~spark_projections.errors.JavaNotFoundError` /
    :class:`~spark_projections.errors.JavaTooOldError` and, in offline mode or when a jar
    ``spark.jars`` lists is missing, :class:`~spark_projections.errors.DeltaJarsUnavailableError`;
    with executors of their own, :class:`~spark_projections.errors.ExecutorSetupError` when a
    ``local:`` jar is missing on one (see :func:`~spark_projections.executors.check_executor_jars`);
    when the JVM dies during
    start-up, ``DeltaJarsUnavailableError`` (jar resolution) or
    :class:`~spark_projections.errors.SparkStartupError` with what the JVM printed; and
    :class:`~spark_projections.errors.DeltaNotConfiguredError` when the session came up
    without a working Delta.

    A JVM this call starts takes the Delta jars from ``delta_jars_dir`` if set, else from the
    jars cache (``delta_jars_cache``) when its folder for this Delta and Spark verifies, else
    through Maven, after which the resolved jars are stored in the cache for the next start
    (best effort: a cache that cannot be written is a warning in the log, never an error).
    Processes that resolve through the same Ivy directory do it one at a time
    (:func:`~spark_projections.jars_lock.resolution_lock`, a warning in the log while one
    waits); one that waited takes the jars the other stored in the cache.

    Spark keeps one JVM per Python process: if one is already running (even after
    ``spark.stop()``), jars and static settings of the first start stay in force, and the
    jars settings are not looked at.
    """
    settings = SparkSettings() if settings is None else settings
    local_jars: list[Path] = []
    with contextlib.ExitStack() as resolving:
        if SparkContext._gateway is None:
            conf = build_conf(settings)
            held: tuple[int, ...] = ()
            if "spark.jars.packages" in conf:
                # Through Ivy: one process at a time, and the cache the one before filled spares the download.
                lock = resolving.enter_context(resolution_lock(ivy_directory(conf)))
                conf = build_conf(settings)
                held = (lock.fd,) if "spark.jars.packages" in conf else ()
            local_jars = check_listed_jars(conf.get("spark.jars", ""))
            check_java()
            # Some Python workers (the data source planner's) are started by the JVM from
            # PYSPARK_PYTHON as it was at launch; without it they run python3 from PATH.
            os.environ.setdefault("PYSPARK_PYTHON", conf["spark.pyspark.python"])
            spark = _start_jvm_and_session(
                conf, coordinate=conf.get("spark.jars.packages"), log=settings.startup_log, held_fds=held
            )
            resolved_by_maven = "spark.jars.packages" in conf
        else:
            # A JVM already runs in this process: nothing to launch, the builder reuses it
            # (and any active SparkContext). ensure_delta() below catches a Delta-less one.
            conf = _conf(settings, {})
            builder = SparkSession.builder
            for key, value in conf.items():
                builder = builder.config(key, value)
            spark = builder.getOrCreate()
            resolved_by_maven = False
        spark.sparkContext.setLogLevel(settings.log_level)
        _quiet_loggers(spark)
        _use_python_workers(spark, conf["spark.pyspark.python"])
        ensure_delta(spark)
        check_executor_jars(spark, [str(jar) for jar in local_jars])
        register(spark)
        cache = _cache_folder(settings)
        if resolved_by_maven and cache is not None:
            _fill_cache(spark, cache, conf["spark.jars.packages"])
    return spark


def jvm_process() -> subprocess.Popen[bytes] | None:
    """The JVM :func:`spark_session` launched in this process, while it runs; None when it launched none (a session
    made otherwise, or none yet) or it has exited. The ``jetsourcing spark`` commands stop it on Ctrl-C."""
    return _launched if _launched is not None and _launched.poll() is None else None


_launched: subprocess.Popen[bytes] | None = None

# Loggers of messages that tell a user of jetsourcing nothing to act on, and the level they start at.
_QUIET_JVM_LOGGERS = {
    # "Truncated the string representation of a plan since it was too large": once per JVM, about the debug
    # text of plans of more than spark.sql.debug.maxToStringFields columns (Delta's own log queries have more).
    # Raising that limit instead would make Spark build longer plan texts for every query.
    "org.apache.spark.util.SparkStringUtils": "ERROR",
}


def _quiet_loggers(spark: SparkSession) -> None:
    """Keep the JVM's and py4j's routine messages off the terminal; their warnings and errors stay."""
    # py4j logs each connection it closes at INFO ("Closing down clientserver connection", at every exit);
    # a level set on purpose is kept, and so are DEBUG runs.
    py4j = logging.getLogger("py4j")
    if py4j.level == logging.NOTSET and not py4j.isEnabledFor(logging.DEBUG):
        py4j.setLevel(logging.WARNING)
    try:
        jvm: Any = spark.sparkContext._jvm
        for name, level in _QUIET_JVM_LOGGERS.items():
            jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
                name, jvm.org.apache.logging.log4j.Level.toLevel(level)
            )
    except Py4JError:  # another logging backend than Spark's log4j 2: its messages stay
        pass


def _fill_cache(spark: SparkSession, folder: Path, coordinate: str) -> None:
    """Keep the jars Maven resolved for ``spark`` in the cache ``folder``, or say in the log why not."""
    try:
        store_delta_jars(session_jars(spark), folder, coordinate)
    except (OSError, SparkProjectionError) as exc:
        logger.warning(
            "The Delta jars could not be stored in the cache %s (%s), so the next start resolves them through "
            "Maven again. Set JETSOURCING_SPARK_DELTA_JARS_CACHE to a folder you can write.", folder, exc
        )


def _use_python_workers(spark: SparkSession, python: str) -> None:
    """Make Python UDFs and data sources of this context run on ``python``.

    PySpark's SparkContext takes the worker interpreter from the PYSPARK_PYTHON environment
    variable (default ``python3`` from PATH) and ignores ``spark.pyspark.python``; every
    Python function it ships to the JVM carries ``sc.pythonExec``. Setting it here covers
    contexts we created and ones that already existed.
    """
    spark.sparkContext.pythonExec = python


def ensure_delta(spark: SparkSession) -> None:
    """Raise :class:`~spark_projections.errors.DeltaNotConfiguredError` unless Delta works.

    Checks that the session has Delta's SQL extension and catalog configured, that Delta's
    classes are on the JVM classpath, and that the session catalog really is Delta's (the
    point where a missing jar otherwise fails, long after a start-up warning).
    """
    restart = (
        "Spark keeps one JVM per Python process and a running session cannot gain jars or "
        "SQL extensions: create the session with spark_projections.session.spark_session() "
        "before anything else creates one, or restart the Python process."
    )
    extensions = [e.strip() for e in (spark.conf.get("spark.sql.extensions", "") or "").split(",")]
    catalog = spark.conf.get("spark.sql.catalog.spark_catalog", None)
    if DELTA_EXTENSION not in extensions or catalog != DELTA_CATALOG:
        raise DeltaNotConfiguredError(
            "This Spark session was created without Delta Lake "
            f"(spark.sql.extensions={','.join(e for e in extensions if e) or '<unset>'}, "
            f"spark.sql.catalog.spark_catalog={catalog or '<unset>'}). {restart}"
        )
    jvm: Any = spark.sparkContext._jvm
    if not isinstance(jvm.io.delta.tables.DeltaTable, JavaClass):
        raise DeltaNotConfiguredError(
            "Delta Lake is configured in this Spark session but its classes are not on the "
            "classpath (Spark only warned about it at start-up). The jars were not loaded: "
            "check spark.jars / spark.jars.packages of the process's first session. "
            + restart
        )
    try:
        jsession: Any = spark._jsparkSession
        loaded = jsession.sessionState().catalogManager().v2SessionCatalog().getClass().getName()
    except Py4JError as exc:
        raise DeltaNotConfiguredError(
            f"Delta's session catalog could not be loaded: {_first_line(exc)}. {restart}"
        ) from exc
    if loaded != DELTA_CATALOG:
        raise DeltaNotConfiguredError(
            f"The session catalog is {loaded}, not Delta's {DELTA_CATALOG}. {restart}"
        )


def _start_jvm_and_session(
    conf: dict[str, str], *, coordinate: str | None, log: Path | None, held_fds: tuple[int, ...] = ()
) -> SparkSession:
    """Launch the JVM ourselves so its stderr can be captured, then build the session.

    PySpark lets the JVM inherit stderr, so when it dies during start-up the only thing
    Python learns is ``JAVA_GATEWAY_EXITED``. We pass a pipe instead: a thread writes the
    start-up output (Ivy's resolution report is long) to ``log`` and keeps its tail, which
    :func:`~spark_projections.jars.diagnose_launch_failure` reads on failure; once the
    session is up, it forwards what follows to our stderr (Spark's warnings appear as usual).
    ``held_fds`` are handed to the JVM (the jars resolution lock, which it then holds while it lives).
    """
    global _launched
    spark_conf = SparkConf(loadDefaults=False)
    spark_conf.setAll(list(conf.items()))
    try:
        if log is None:  # a new file of our own: a predictable name in a shared directory could be anyone's
            fd, name = tempfile.mkstemp(prefix="jetsourcing-spark-startup-", suffix=".log")
            sink, log = os.fdopen(fd, "wb"), Path(name)
        else:
            log.parent.mkdir(parents=True, exist_ok=True)
            sink = open(log, "wb")
    except OSError as exc:
        raise SparkStartupError(
            f"Cannot write Spark's start-up log {log or 'in the temporary directory'}: {exc}. Set "
            "JETSOURCING_SPARK_STARTUP_LOG to a file you can write."
        ) from exc
    tee = _StderrTee(sink)
    # launch_gateway hands the JVM a copy of os.environ and offers no other way in. For a
    # local master, SPARK_LOCAL_IP keeps Spark from resolving the hostname to some other
    # interface (and warning about it) before spark.driver.bindAddress applies.
    added_local_ip = conf["spark.master"].startswith("local") and "SPARK_LOCAL_IP" not in os.environ
    if added_local_ip:
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    try:
        # launch_gateway is unannotated upstream; its `popen_kwargs` is the documented hook
        # for "capturing stdout/stderr".
        gateway = launch_gateway(  # type: ignore[no-untyped-call]
            spark_conf, popen_kwargs={"stderr": tee.write_fd, "pass_fds": held_fds}
        )
        _launched = gateway.proc  # "a reference to the Popen object for use by the caller", says PySpark
    except PySparkRuntimeError as exc:
        tee.close_write_end()
        tee.wait_for_eof(timeout=10.0)
        raise _naming_log(diagnose_launch_failure(tee.text(), coordinate=coordinate), log) from exc
    finally:
        if added_local_ip:
            del os.environ["SPARK_LOCAL_IP"]
    tee.close_write_end()
    try:
        # Passing the gateway makes SparkContext reuse this JVM instead of launching one.
        context = SparkContext(conf=spark_conf, gateway=gateway)
    except Py4JError as exc:
        raise _naming_log(
            SparkStartupError(f"Spark failed to create its context: {_first_line(exc)}", jvm_output=tee.text()), log
        ) from exc
    finally:
        # Past start-up the tail is no longer needed; forwarding continues.
        tee.stop_recording()
    return SparkSession(context)


def _naming_log(error: SparkProjectionError, log: Path) -> SparkProjectionError:
    """``error``, its message ending with where the whole start-up output is."""
    error.args = (f"{error.args[0] if error.args else error} (The JVM's whole start-up output is in {log}.)",
                  *error.args[1:])
    return error


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if line.strip() and not line.startswith("An error occurred while calling"):
            return line.strip().lstrip(": ")
    return text or type(exc).__name__


class _StderrTee:
    """A pipe to hand to the JVM as stderr: during start-up written to the ``log`` file (tail kept in memory),
    then forwarded to our fd 2."""

    def __init__(self, log: BinaryIO, max_lines: int = 400) -> None:
        self._log = log  # closed when start-up ends or the JVM exits
        read_fd, self.write_fd = os.pipe()
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._recording = True
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._pump, args=(read_fd,), name="spark-jvm-stderr", daemon=True
        )
        self._thread.start()

    def _pump(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as source:
            for line in iter(source.readline, b""):
                with self._lock:
                    if self._recording:
                        self._lines.append(line.decode("utf-8", errors="replace").rstrip("\n"))
                        self._log.write(line)
                        self._log.flush()
                        continue
                try:
                    _write_all(2, line)
                except OSError:  # our stderr is gone; keep draining so the JVM never blocks
                    pass
        with self._lock:
            self._log.close()

    def close_write_end(self) -> None:
        """Close our copy of the write end; the JVM keeps its own until it exits."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def wait_for_eof(self, timeout: float) -> None:
        """Wait until every writer closed the pipe (the JVM exited) or ``timeout`` passes."""
        self._thread.join(timeout)

    def stop_recording(self) -> None:
        with self._lock:
            self._recording = False
            self._lines.clear()
            self._log.close()

    def text(self) -> str:
        with self._lock:
            return "\n".join(self._lines)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]

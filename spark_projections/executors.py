"""What Spark's executors need of the driver's world, checked from the driver before the work starts.

Executors read the stream themselves, over their own connections, with the
settings' credential and TLS files, and their Python workers import the user's
code by module name. Under a ``local`` master they run beside the driver and
share its files; on a cluster (or ``local-cluster``, Spark's test mode with
executors of their own) any of these can be missing, and a task that finds it
missing fails far from the cause, retried and wrapped in JVM traces. These
checks fail first, with one :class:`ExecutorSetupError` (or
:class:`~spark_projections.errors.EventSourceError` for the URL) that says
what to do:

* :func:`preflight` - both checks of what the executors read the stream with:
  :func:`check_reachable` (a NATS URL only the driver's host can reach) and
  :func:`check_executor_files` (credential and TLS files missing where the
  executors look for them: one small Spark job, once per application);
* :func:`check_executor_jars` - ``local:`` jars missing on the executors' disks;
* :func:`executor_imports` - the executors' ``ModuleNotFoundError`` turned into
  one that names the module and the way to get it there.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial, wraps
from typing import Concatenate, ParamSpec, TypeVar
from urllib.parse import urlsplit

from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from eventstore import EventStoreSettings
from eventstore.security import redact_url
from spark_projections.errors import EventSourceError, ExecutorSetupError
from spark_projections.ship import SHIP_CODE_CONF, shipped_to, shipping

__all__ = [
    "check_executor_files",
    "check_executor_jars",
    "check_reachable",
    "executor_imports",
    "preflight",
    "reports_missing_modules",
    "separate_executors",
]

_LOOPBACK = re.compile(r"^(localhost|127(\.\d{1,3}){3}|\[?::1\]?|0\.0\.0\.0)$", re.I)
_IN_PROCESS = re.compile(r"local(\[[^\]]*\])?")
_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")
_P = ParamSpec("_P")
_T = TypeVar("_T")
_lock = threading.Lock()
_checked: set[tuple[str, tuple[tuple[str, str], ...]]] = set()  # (application id, files) found everywhere


def separate_executors(spark: SparkSession) -> bool:
    """Whether ``spark``'s executors are processes of their own (any master but ``local`` / ``local[...]``)."""
    return _IN_PROCESS.fullmatch(spark.sparkContext.master or "") is None


def check_reachable(spark: SparkSession, nats_url: str) -> None:
    """Refuse a NATS URL only this host can reach when the executors may run on other hosts.

    Executors read the stream themselves: under a master that is not ``local``
    (``local[N]``, ``local-cluster[...]``), a URL whose every server is a
    loopback address (an embedded server's ``nats://127.0.0.1:...``) points
    each executor at its own host. Raises :class:`EventSourceError` saying so.
    """
    master = spark.sparkContext.master or ""
    if master.startswith("local"):
        return
    hosts = [urlsplit(url.strip() if "://" in url else f"nats://{url.strip()}").hostname or "" for url in nats_url.split(",")]
    if hosts and all(_LOOPBACK.match(host) for host in hosts):
        raise EventSourceError(
            f"The NATS URL {redact_url(nats_url)} is a loopback address, but Spark's master is {master!r}: executors "
            "on other hosts would each look for a server on their own host. Give an address the executors can reach "
            "(NATS_URL=nats://<host>:4222), or run with a local master."
        )


def preflight(spark: SparkSession, settings: EventStoreSettings) -> None:
    """Check, before a read of the stream starts, that ``spark``'s executors can open it with ``settings``.

    Runs :func:`check_reachable` on the settings' URL, then
    :func:`check_executor_files`: the first problem found is raised.
    """
    if settings.nats_url is not None:
        check_reachable(spark, settings.nats_url)
    check_executor_files(spark, settings)


def check_executor_files(spark: SparkSession, settings: EventStoreSettings) -> None:
    """Make sure the settings' credential and TLS files are readable where the executors look for them.

    The files are read where each connection is made, so on a cluster they must
    exist at the same path on every executor (a mounted secret, the same image).
    With executors of their own, one task per executor core looks for them (a
    small Spark job, run again only for other files or another application):
    :class:`ExecutorSetupError` names each file missing and the hosts it is
    missing on. A relative path is looked up from each executor's own working
    directory, which is not the driver's. Nothing is checked under a ``local``
    master, whose executors share the driver's files (the settings checked them).
    """
    found = _missing_on_executors(spark, [(name, str(path)) for name, path in settings.files().items()])
    if found:
        raise ExecutorSetupError(_missing_files_message(
            "The executors read the stream with the settings' files, each where it runs, but", found,
            "Put the files at the same path on every executor (a mounted secret, the same image), or point the "
            "settings (JETSOURCING_<SETTING>) at a path every executor has.",
        ))


def check_executor_jars(spark: SparkSession, jars: Sequence[str]) -> None:
    """Make sure the ``local:`` jars of ``spark.jars`` (``jars``, paths) are on every executor's own disk.

    Spark hands the executors every other jar it lists itself, but a ``local:``
    one each node must have at that path; without Delta's there, the first
    Delta job fails in the executors. Checked as :func:`check_executor_files`
    checks files: :class:`ExecutorSetupError` names the jars missing and where.
    """
    found = _missing_on_executors(spark, [("the local: jar", jar) for jar in jars])
    if found:
        raise ExecutorSetupError(_missing_files_message(
            "A local: jar is read from each executor's own disk, but", found,
            "Install the jars at that path on every executor, or list them as files (file:/ or a plain path) in "
            "spark.jars, which Spark hands to the executors itself.",
        ))


def _missing_on_executors(spark: SparkSession, files: Sequence[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(host, name, path) for each of ``files`` (name, path) some executor cannot read: one task per executor core, once per
    application and set of files. Nothing is looked for (and [] returned) without executors of their own."""
    if not files or not separate_executors(spark):
        return []
    context = spark.sparkContext
    key = (context.applicationId, tuple(sorted(files)))
    with _lock:
        if key in _checked:
            return []
    tasks = max(context.defaultParallelism, 1)
    found: list[tuple[str, str, str]] = (
        context.parallelize(range(tasks), tasks).mapPartitions(partial(_missing_here, files)).distinct().collect()
    )
    if not found:
        with _lock:
            _checked.add(key)
    return found


def _missing_here(files: Sequence[tuple[str, str]], _: Iterable[int]) -> Iterator[tuple[str, str, str]]:
    """In an executor: (host, setting, path) for each of ``files`` this host cannot read."""
    host = socket.gethostname()
    for name, path in files:
        if not (os.path.isfile(path) and os.access(path, os.R_OK)):
            yield host, name, path


def _missing_files_message(opening: str, found: Iterable[tuple[str, str, str]], advice: str) -> str:
    hosts: dict[tuple[str, str], set[str]] = {}
    for host, name, path in found:
        hosts.setdefault((name, path), set()).add(host)
    problems = []
    for (name, path), where in sorted(hosts.items()):
        relative = "" if os.path.isabs(path) else (
            " (a relative path, looked up from each executor's working directory: give an absolute one)"
        )
        problems.append(f"{name} {path}{relative} is not a readable file on {', '.join(sorted(where))}")
    return f"{opening} {'; '.join(problems)}. {advice}"


@contextmanager
def executor_imports(spark: SparkSession) -> Iterator[None]:
    """Turn an executor's ``ModuleNotFoundError`` (it cannot import the user's code) into an :class:`ExecutorSetupError`.

    The error names the module and says how to get it to the executors: turn
    shipping on when it is off (``spark.jetsourcing.shipCode``), or install the
    module there when it is installed code, which is not shipped. Any other
    error passes unchanged, as does a ``ModuleNotFoundError`` on the driver
    (only the errors Spark hands over from its workers are read).
    """
    try:
        yield
    except (PySparkException, Py4JJavaError) as exc:  # the executors' error, as PySpark or py4j hands it over
        found = _MISSING_MODULE.search(str(exc))
        if found is None:
            raise
        raise ExecutorSetupError(_missing_module_message(spark, found.group(1))) from exc


def reports_missing_modules(
    func: Callable[Concatenate[SparkSession, _P], _T],
) -> Callable[Concatenate[SparkSession, _P], _T]:
    """``func`` (which takes the session first) run under :func:`executor_imports`."""

    @wraps(func)
    def run(spark: SparkSession, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with executor_imports(spark):
            return func(spark, *args, **kwargs)

    return run


def _missing_module_message(spark: SparkSession, module: str) -> str:
    top = module.split(".")[0]
    what = f"Spark's Python workers cannot import {module!r} (ModuleNotFoundError)"
    if not shipping(spark):
        return (
            f"{what}: shipping the projection's code to the executors is off ({SHIP_CODE_CONF}=false, "
            "JETSOURCING_SPARK_SHIP_CODE=false). Install it on every executor (an image, a wheel), or turn shipping on."
        )
    if top in shipped_to(spark):
        return f"{what}, although {top!r} was shipped to them: check that it imports on the driver from a clean process."
    return (
        f"{what}: only the projection's own package or module is shipped, not installed code. Install {top!r} on "
        "every executor as it is installed on the driver (pip install it in the executors' image or environment)."
    )

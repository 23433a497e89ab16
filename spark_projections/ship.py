"""Ship the user's projection code to Spark's executors.

A projection's handlers, a DataFrame projection's ``build`` and the events'
pydantic models run in the executors' Python workers, which import them by
module name. On a cluster those workers run on other hosts, from another
Python environment: a module that is not installed there fails with
``ModuleNotFoundError``. :func:`ship_code` hands the top-level package (or the
single module) each of them comes from to ``SparkContext.addPyFile``, zipped,
once per Spark application, before the first job that needs it.

What is installed is not shipped: a module under the Python installation's
``site-packages`` (or its standard library) is expected on the executors as
it is on the driver, and so is jetsourcing itself, which the executors need
installed anyway for the ``jetstream`` source. Set the Spark conf
``spark.jetsourcing.shipCode`` to ``false`` (``SparkSettings.ship_code``,
``JETSOURCING_SPARK_SHIP_CODE``) when the code is installed on the executors
(an image, a wheel) and nothing should be shipped.
"""

from __future__ import annotations

import sys
import sysconfig
import tempfile
import threading
import zipfile
from collections.abc import Iterable
from pathlib import Path

from pyspark.sql import SparkSession

__all__ = ["SHIP_CODE_CONF", "ship_code", "shipped_from", "shipped_to", "shipping"]

SHIP_CODE_CONF = "spark.jetsourcing.shipCode"
"""The Spark conf that turns shipping off (``false``); on by default."""

_FRAMEWORK = frozenset({"eventstore", "aggregates", "projections", "spark_projections", "pyspark", "delta"})
_lock = threading.Lock()
_shipped: dict[str, set[str]] = {}  # Spark application id -> the top-level names it was given


def shipped_from(objects: Iterable[object]) -> dict[str, Path]:
    """The top-level package or module of each object's class (or of the object, for a class or function) that
    needs shipping, by name: the file or folder to ship."""
    found: dict[str, Path] = {}
    installed = [Path(p).resolve() for p in {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}]
    for obj in objects:
        module_name = getattr(obj if isinstance(obj, type) or callable(obj) else type(obj), "__module__", None)
        if not module_name or module_name == "__main__":
            continue
        top = module_name.split(".")[0]
        module = sys.modules.get(top)
        file = getattr(module, "__file__", None)
        if top in _FRAMEWORK or top in found or file is None:
            continue
        path = Path(file).resolve()
        if any(path.is_relative_to(root) for root in installed):
            continue
        found[top] = path.parent if path.name == "__init__.py" else path
    return found


def ship_code(spark: SparkSession, objects: Iterable[object]) -> list[str]:
    """Give the executors the user code ``objects`` come from (see the module docs); returns the top-level names
    shipped by this call (none when they were shipped before, are installed, or shipping is off)."""
    if not shipping(spark):
        return []
    context = spark.sparkContext
    new: list[str] = []
    with _lock:
        done = _shipped.setdefault(context.applicationId, set())
        for name, path in shipped_from(objects).items():
            if name in done:
                continue
            context.addPyFile(str(path if path.is_file() else _zip(name, path)))
            done.add(name)
            new.append(name)
    return new


def shipping(spark: SparkSession) -> bool:
    """Whether :func:`ship_code` ships anything in ``spark`` (``spark.jetsourcing.shipCode`` is not ``false``)."""
    return (spark.conf.get(SHIP_CODE_CONF, "true") or "true").strip().lower() != "false"


def shipped_to(spark: SparkSession) -> set[str]:
    """The top-level names :func:`ship_code` has given ``spark``'s application so far."""
    with _lock:
        return set(_shipped.get(spark.sparkContext.applicationId, ()))


def _zip(name: str, folder: Path) -> Path:
    """``folder`` (the package ``name``) zipped, as ``addPyFile`` takes a package; compiled files left out."""
    target = Path(tempfile.mkdtemp(prefix="jetsourcing-ship-")) / f"{name}.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in sorted(folder.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file.suffix not in (".pyc", ".pyo"):
                archive.write(file, Path(name) / file.relative_to(folder))
    return target

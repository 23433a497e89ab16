"""Typed errors raised by ``spark_projections``.

Every error here is a :class:`SparkProjectionError`, so a caller (or the CLI) can catch
one type and print ``str(error)``: each message says what was wrong and what to do about
it, and never needs a JVM stack trace to be understood. The structured fields on each
class carry the same facts for programs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

__all__ = [
    "DeltaJarsUnavailableError",
    "DeltaNotConfiguredError",
    "DuplicateKeysError",
    "EventSourceError",
    "ExecutorSetupError",
    "JarsProblem",
    "JavaNotFoundError",
    "JavaTooOldError",
    "SchemaMismatchError",
    "SparkProjectionError",
    "SparkStartupError",
    "SparkUsageError",
    "root_cause",
]


class SparkProjectionError(Exception):
    """Base class of every error ``spark_projections`` raises on purpose.

    Guarantees ``str(error)`` is a complete, user-readable explanation with a remedy.
    """


class SparkUsageError(SparkProjectionError):
    """What the command line or the environment gave cannot be used as it is: an import path that names no
    projection, an invalid ``JETSOURCING_SPARK_*`` value. The ``jetsourcing spark`` commands exit 2 for it, as for
    arguments argparse refuses (any other :class:`SparkProjectionError`: 1)."""


class JavaNotFoundError(SparkProjectionError):
    """No usable ``java`` executable was found, so Spark cannot start.

    Raised before any JVM is launched. ``looked_at`` says where we looked (the
    ``JAVA_HOME`` binary or ``PATH``); ``detail`` carries the OS error or the output of a
    ``java -version`` that could not be parsed, when there was one.
    """

    def __init__(self, looked_at: str, detail: str | None = None) -> None:
        self.looked_at = looked_at
        self.detail = detail
        message = (
            f"Java was not found ({looked_at}). Spark needs a Java 17 or newer runtime. "
            "Install one (e.g. `apt-get install openjdk-17-jre-headless`) and either put "
            "`java` on PATH or set JAVA_HOME to its installation directory."
        )
        if detail:
            message += f"\nDetail: {detail}"
        super().__init__(message)


class JavaTooOldError(SparkProjectionError):
    """The Java runtime Spark would use is older than Spark 4 supports (17).

    Raised before any JVM is launched. ``java`` is the executable that was checked,
    ``version`` the version string it reported, ``major`` its parsed major version.
    """

    def __init__(self, java: Path, version: str, major: int, minimum: int) -> None:
        self.java = java
        self.version = version
        self.major = major
        self.minimum = minimum
        super().__init__(
            f"Java {version} (major version {major}) at {java} is too old: Spark 4 needs "
            f"Java {minimum} or newer. Install Java {minimum}+ and point JAVA_HOME at it "
            "(or put its `java` first on PATH when JAVA_HOME is unset)."
        )


JarsProblem = Literal[
    "maven_unreachable",
    "artifact_not_found",
    "offline_dir_missing",
    "offline_jars_missing",
    "offline_jars_incompatible",
    "jar_missing",
    "resolution_busy",
]
"""Why the Delta jars could not be made available (see :class:`DeltaJarsUnavailableError`)."""


class DeltaJarsUnavailableError(SparkProjectionError):
    """The Delta Lake jars could not be put on Spark's classpath.

    ``problem`` distinguishes the cases a user fixes differently:

    * ``maven_unreachable`` - online mode, the Maven repository could not be contacted;
    * ``artifact_not_found`` - online mode, the repository answered but has no such
      artifact (usually a Delta version that was never published for this Spark);
    * ``offline_dir_missing`` / ``offline_jars_missing`` / ``offline_jars_incompatible`` -
      offline mode, the configured jars folder is absent, lacks the Delta jars, or holds
      jars built for another Spark version;
    * ``jar_missing`` - a jar ``spark.jars`` lists is not where it says;
    * ``resolution_busy`` - online mode, another process kept resolving jars in the same Ivy directory for
      longer than this one waits (:mod:`spark_projections.jars_lock`).

    ``jvm_output`` holds the relevant lines Spark printed, when the failure came from the JVM.
    """

    def __init__(
        self,
        problem: JarsProblem,
        message: str,
        *,
        coordinate: str | None = None,
        jars_dir: Path | None = None,
        jvm_output: str | None = None,
    ) -> None:
        self.problem: JarsProblem = problem
        self.coordinate = coordinate
        self.jars_dir = jars_dir
        self.jvm_output = jvm_output
        full = message
        if jvm_output:
            full += f"\nWhat Spark reported:\n{jvm_output}"
        super().__init__(full)


class DeltaNotConfiguredError(SparkProjectionError):
    """A Spark session exists but Delta Lake is not usable in it.

    Typical causes: a session without Delta was created earlier in this process (Spark
    keeps one JVM per process, so jars and SQL extensions cannot be added afterwards),
    or the Delta extension is configured but its classes are not on the classpath
    (Spark only logs a warning for that at start-up).
    """


class SparkStartupError(SparkProjectionError):
    """The Spark JVM failed to start for a reason other than Java or the Delta jars.

    ``jvm_output`` holds the last lines the JVM printed, which name the real cause.
    """

    def __init__(self, message: str, jvm_output: str | None = None) -> None:
        self.jvm_output = jvm_output
        full = message
        if jvm_output:
            full += f"\nWhat Spark reported:\n{jvm_output}"
        super().__init__(full)


class DuplicateKeysError(SparkProjectionError):
    """An incremental update held more than one row for some key.

    A MERGE needs exactly one source row per key; otherwise the result depends on row order
    (and Delta would insert duplicates for new keys). ``examples`` lists up to a few
    offending keys with their row counts.
    """

    def __init__(self, keys: Sequence[str], examples: Sequence[tuple[object, ...]]) -> None:
        self.keys = tuple(keys)
        self.examples = tuple(examples)
        shown = ", ".join(
            f"{e[0]!r} ({e[-1]} rows)" if len(e) == 2 else f"{e[:-1]!r} ({e[-1]} rows)"
            for e in examples
        )
        super().__init__(
            f"The updates hold several rows per key {list(self.keys)}: {shown}. "
            "Fold them to one row per key first, e.g. with "
            "spark_projections.delta.latest_per_key(df, keys, order_col)."
        )


class SchemaMismatchError(SparkProjectionError):
    """An incremental update's columns differ from the target table's columns.

    A MERGE updates and inserts whole rows, so both sides must have the same columns.
    """

    def __init__(self, path: str, missing: Sequence[str], extra: Sequence[str]) -> None:
        self.path = path
        self.missing = tuple(missing)
        self.extra = tuple(extra)
        super().__init__(
            f"The updates for {path} do not have the table's columns "
            f"(missing: {list(self.missing)}, unknown: {list(self.extra)}). "
            "A projection whose shape changed needs a full rebuild "
            "(spark_projections.delta.full_rebuild) under a new app_id."
        )


class EventSourceError(SparkProjectionError):
    """The ``jetstream`` data source was misconfigured or could not read the stream."""


class ExecutorSetupError(SparkProjectionError):
    """Spark's executors lack something the driver has: a credential or TLS file at the settings' path, or a module
    of the user's code (see :mod:`spark_projections.executors`). Nothing was written."""


_TRACEBACK = "Traceback (most recent call last):"
_RAISED = re.compile(r"^([A-Za-z_][\w.]*): (.*\S)")  # a traceback's last line: "module.Class: message"
_OURS = ("spark_projections.", "eventstore.", "projections.", "aggregates.")


def root_cause(error: BaseException) -> str:
    """What failed, in one paragraph without a stack trace, whichever process raised it.

    Ours raised on the driver: its message, whole. One raised in a Python
    worker (the source's planner, a partition's read) reaches the driver as
    JVM text holding its traceback: the message of the traceback's last
    exception (with its class name unless it is one of jetsourcing's). Else
    the first line that says something (not py4j's "An error occurred while
    calling o123.method.").
    """
    if isinstance(error, SparkProjectionError):
        return str(error).strip()
    text = str(error)
    start = text.find(_TRACEBACK)
    if start >= 0:
        raised = None
        for line in text[start:].splitlines():
            if line.startswith(("\tat ", " SQLSTATE", "\tat\t")) or line.strip().startswith("at org.apache."):
                break  # the JVM's frames: the Python traceback is over
            found = _RAISED.match(line)
            if found:
                raised = found
        if raised is not None:
            name, message = raised.groups()
            return message if name.startswith(_OURS) else f"{name.rsplit('.', 1)[-1]}: {message}"
    for line in text.splitlines():
        line = line.strip().lstrip(": ")
        if line and not line.startswith("An error occurred while calling"):
            return line
    return type(error).__name__


NO_SERVER = (
    "No NATS server is set: Spark reads the events from a running server. Set NATS_URL (or settings.nats_url), "
    "e.g. to the URL `jetsourcing server` prints."
)
"""What every Spark entry point says when it is given no server (it never starts an empty embedded one)."""

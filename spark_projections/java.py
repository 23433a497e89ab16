"""Find the Java runtime Spark will use and check that it is new enough.

Spark's launcher scripts pick ``$JAVA_HOME/bin/java`` when ``JAVA_HOME`` is set and the
first ``java`` on ``PATH`` otherwise; :func:`find_java` mirrors that rule, so the runtime
checked here is the one the JVM will actually run on. Doing this before starting Spark
turns "Java gateway process exited" into an error that names the problem.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from spark_projections.errors import JavaNotFoundError, JavaTooOldError

__all__ = ["MIN_JAVA_MAJOR", "JavaRuntime", "check_java", "find_java", "parse_java_version"]

MIN_JAVA_MAJOR = 17
"""Spark 4.x runs on Java 17 and 21; older runtimes fail inside the launcher."""

# `java -version` prints e.g. `openjdk version "17.0.15" 2025-04-15`,
# `java version "1.8.0_292"` or `openjdk version "21" 2023-09-19`; other lines
# (e.g. "Picked up JAVA_TOOL_OPTIONS") may precede it.
_VERSION_RE = re.compile(r'version\s+"(?P<version>[^"]+)"')


@dataclass(frozen=True)
class JavaRuntime:
    """A Java runtime that passed :func:`check_java`: its executable and version."""

    executable: Path
    version: str
    major: int


def parse_java_version(output: str) -> tuple[str, int]:
    """Return ``(version string, major version)`` from ``java -version`` output.

    Handles both the legacy ``1.x`` scheme (``"1.8.0_292"`` -> 8) and the modern one
    (``"17.0.15"`` -> 17, ``"21"`` -> 21, ``"22-ea"`` -> 22). Raises ``ValueError`` when no
    version can be found.
    """
    match = _VERSION_RE.search(output)
    if match is None:
        raise ValueError(f"no version in java -version output: {output.strip()[:200]!r}")
    version = match.group("version")
    parts = re.split(r"[.\-_+]", version)
    try:
        first = int(parts[0])
        major = int(parts[1]) if first == 1 and len(parts) > 1 else first
    except ValueError:
        raise ValueError(f"unparseable Java version {version!r}") from None
    return version, major


def find_java(env: Mapping[str, str] | None = None) -> Path:
    """Return the ``java`` executable Spark's launcher would run.

    ``JAVA_HOME`` wins when set (even if it is wrong: Spark would use it too, so we report
    it rather than silently fall back to ``PATH``). Raises :class:`JavaNotFoundError`.
    """
    env = os.environ if env is None else env
    java_home = env.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if not (candidate.is_file() and os.access(candidate, os.X_OK)):
            raise JavaNotFoundError(
                f"JAVA_HOME={java_home} has no executable bin/java",
            )
        return candidate
    found = shutil.which("java", path=env.get("PATH"))
    if found is None:
        raise JavaNotFoundError("JAVA_HOME is unset and there is no `java` on PATH")
    return Path(found)


def check_java(
    env: Mapping[str, str] | None = None, *, minimum: int = MIN_JAVA_MAJOR
) -> JavaRuntime:
    """Find the Java Spark would use, run ``java -version`` and require ``minimum``+.

    Raises :class:`JavaNotFoundError` when there is no runnable Java or its version cannot
    be read, and :class:`JavaTooOldError` when it is older than ``minimum``.
    """
    java = find_java(env)
    try:
        completed = subprocess.run(
            [str(java), "-version"],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ if env is None else env),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JavaNotFoundError(f"{java} could not be run", detail=str(exc)) from exc
    # `java -version` writes to stderr; some wrappers use stdout.
    output = completed.stderr + completed.stdout
    if completed.returncode != 0:
        raise JavaNotFoundError(
            f"`{java} -version` exited with status {completed.returncode}",
            detail=output.strip()[:500] or None,
        )
    try:
        version, major = parse_java_version(output)
    except ValueError as exc:
        raise JavaNotFoundError(f"{java} did not report a version", detail=str(exc)) from exc
    if major < minimum:
        raise JavaTooOldError(java, version, major, minimum)
    return JavaRuntime(executable=java, version=version, major=major)

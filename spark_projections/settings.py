"""Settings for the Spark session used by batch projections.

:class:`SparkSettings` reads ``JETSOURCING_SPARK_*`` environment variables (explicit
constructor arguments win over them), so a deployment can switch e.g. to offline jars
or another master without code changes::

    JETSOURCING_SPARK_MASTER=local[4]
    JETSOURCING_SPARK_DELTA_JARS_DIR=/opt/jetsourcing/delta-jars
    JETSOURCING_SPARK_EXTRA_CONF='{"spark.driver.memory": "4g"}'
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "DEFAULT_MAX_EVENTS_PER_TRIGGER",
    "DELTA_MAVEN_VERSION",
    "TEST_PROFILE_CONF",
    "SparkSettings",
    "check_master",
    "default_delta_jars_cache",
]

DEFAULT_MAX_EVENTS_PER_TRIGGER = 10_000_000
"""Stream positions per micro-batch of a streaming read or ``follow``, unless told otherwise.

Every micro-batch of ``follow`` pays a fixed second or so (a Delta MERGE per
table, planning) while its events stream through the fold without being held,
so a large bound catches up fastest; this one bounds what a crash makes a
follower read again to some 30 s of work on a 2-core machine."""

DELTA_MAVEN_VERSION = "4.4.0"
"""Version of ``io.delta:delta-spark_<spark>_2.13`` put on the classpath by default.

Deliberately pinned rather than taken from the installed ``delta-spark`` wheel (which is
what ``delta.configure_spark_with_delta_pip`` does): the wheel is 4.4.1, but Maven Central
only publishes ``delta-spark_4.2_2.13`` 4.4.0, so the wheel-derived coordinate cannot be
resolved and Spark would not start. The Python ``delta`` package is a thin py4j wrapper;
the same major.minor (4.4) is what has to match, which a test checks.
"""

TEST_PROFILE_CONF: dict[str, str] = {
    # Tiny data on 2 cores: more tasks only add scheduling overhead.
    "spark.default.parallelism": "2",
    # Short-lived JVM on 2 cores: C2 compiler threads cost more CPU than the optimised code
    # saves before the process ends (measured: the first Delta writes took about half the
    # time with C1 only).
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
    # Progress bars interleave with pytest output.
    "spark.ui.showConsoleProgress": "false",
    # Timestamps must not depend on the machine running the tests.
    "spark.sql.session.timeZone": "UTC",
}
"""Extra Spark configuration of :meth:`SparkSettings.test_profile`."""

# The masters spark-submit and SparkContext accept (SparkMasterRegex, SparkSubmit's cluster
# managers); thread, core and memory counts of 0 pass their regexes but fail at start-up.
_MASTER_RE = re.compile(
    r"local"
    r"|local\[(\*|[1-9]\d*)(\s*,\s*[1-9]\d*)?\]"
    r"|local-cluster\[\s*[1-9]\d*\s*,\s*[1-9]\d*\s*,\s*[1-9]\d*\s*\]"
    r"|spark://[^\s,/]+:\d+(,[^\s,/]+:\d+)*"
    r"|yarn"
    r"|k8s://\S+"
)


def check_master(master: str) -> str:
    """``master`` unchanged if Spark accepts it as a master URL; otherwise ``ValueError`` saying which forms it
    accepts, so a typo fails before a JVM starts rather than in it."""
    if _MASTER_RE.fullmatch(master) is None:
        raise ValueError(
            f"{master!r} is not a Spark master. Spark takes local, local[N] or local[*] (N threads, at least 1), "
            "local[N,F] (F attempts per task), local-cluster[N,C,M], spark://HOST:PORT (or spark://H1:P1,H2:P2), "
            "yarn or k8s://URL."
        )
    return master


def default_delta_jars_cache() -> Path | None:
    """Where :attr:`SparkSettings.delta_jars_cache` is by default: ``$XDG_CACHE_HOME/jetsourcing/delta-jars``,
    or ``~/.cache/jetsourcing/delta-jars`` when ``XDG_CACHE_HOME`` is unset or relative (the XDG specification
    ignores relative values). ``None`` (no cache) when the user has no home directory."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    return base / "jetsourcing" / "delta-jars" if base.is_absolute() else None


class SparkSettings(BaseSettings):
    """How to build the projection Spark session (see :func:`spark_projections.session.spark_session`).

    Every field can be set with an environment variable ``JETSOURCING_SPARK_<FIELD>``
    (``extra_conf`` as a JSON object). Instances are immutable.
    """

    model_config = SettingsConfigDict(env_prefix="JETSOURCING_SPARK_", frozen=True, extra="forbid")

    master: str = "local[*]"
    """Spark master URL; checked with :func:`check_master`."""

    app_name: str = "jetsourcing"
    """Spark application name (shown in logs and the UI)."""

    shuffle_partitions: PositiveInt = 16
    """``spark.sql.shuffle.partitions``; Spark's default of 200 is far too many for one machine."""

    delta_version: str = DELTA_MAVEN_VERSION
    """Delta Lake version resolved from Maven Central in online mode."""

    delta_jars_dir: Path | None = None
    """Offline mode: folder of jars (see ``jetsourcing spark fetch-delta-jars``); no download."""

    delta_jars_cache: Path | None = Field(default_factory=default_delta_jars_cache)
    """Where the Delta jars Maven resolved are kept, one folder per Delta and Spark version, so that later
    sessions start from them without Ivy (see :func:`spark_projections.jars.cached_delta_jars`). Default:
    :func:`default_delta_jars_cache`. Unused when :attr:`delta_jars_dir` is set; ``None`` (an empty
    ``JETSOURCING_SPARK_DELTA_JARS_CACHE``): no cache, Ivy resolves the jars at every start."""

    driver_memory: str | None = None
    """``spark.driver.memory`` (e.g. ``"4g"``); only effective when this call starts the JVM."""

    ui_enabled: bool = False
    """Start the Spark web UI. Off by default: batch jobs rarely need it and it opens a port."""

    log_level: Literal["ALL", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF"] = "WARN"
    """Log level applied to the SparkContext once it exists."""

    startup_log: Path | None = None
    """Where the JVM's start-up output goes (Ivy's resolution of the Delta jars among it), instead of the
    terminal; an error during start-up names it. Default: a new ``jetsourcing-spark-startup-*.log`` in the
    temporary directory. After start-up, Spark's own warnings reach stderr as usual."""

    extra_conf: dict[str, str] = Field(default_factory=dict)
    """Any further Spark configuration; applied last, so it overrides the values above
    (``spark.jars``, ``spark.jars.packages`` and ``spark.sql.extensions`` are merged instead)."""

    ship_code: bool = True
    """Ship the projection's code (its top-level package or module, unless installed) to the executors before
    the first job that needs it (:mod:`spark_projections.ship`); off when the executors have it installed."""

    trigger_s: PositiveFloat = 1.0
    """``follow``: a micro-batch starts every ``trigger_s`` seconds (once the previous one is done)."""

    max_events_per_trigger: PositiveInt = DEFAULT_MAX_EVENTS_PER_TRIGGER
    """``follow``: at most this many stream positions per micro-batch."""

    @field_validator("master")
    @classmethod
    def _known_master(cls, master: str) -> str:
        return check_master(master)

    @field_validator("delta_jars_cache", mode="before")
    @classmethod
    def _empty_is_no_cache(cls, value: object) -> object:
        # An empty variable would otherwise be Path(""), the current directory.
        return None if value == "" else value

    @classmethod
    def test_profile(cls, **overrides: Any) -> SparkSettings:
        """Settings for a tiny, quiet, deterministic test session.

        ``local[2]``, no UI, 2 shuffle partitions, UTC, plus :data:`TEST_PROFILE_CONF`;
        keyword ``overrides`` replace any of these fields. Fields not given still read
        ``JETSOURCING_SPARK_*`` (e.g. ``DELTA_JARS_DIR`` to run the tests offline).
        """
        values: dict[str, Any] = {
            "master": "local[2]",
            "app_name": "jetsourcing-tests",
            "shuffle_partitions": 2,
            "ui_enabled": False,
            "log_level": "ERROR",
            "extra_conf": dict(TEST_PROFILE_CONF),
        }
        values.update(overrides)
        return cls(**values)

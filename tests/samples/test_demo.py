"""The demo as a newcomer runs it (``make demo``), in a subprocess, with small sizes and everything on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_demo(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter: its own embedded nats-server (or NATS_URL's server, on a stream of its own), its own JVM.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JETSOURCING_", "PYSPARK_GATEWAY"))}
    for key in ("JETSOURCING_SPARK_DELTA_JARS_DIR",):  # offline jars, when the suite runs offline
        if key in os.environ:
            env[key] = os.environ[key]
    return subprocess.run(
        [sys.executable, "-m", "samples.demo", "--workdir", str(tmp_path / "demo"), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_the_demo_runs_end_to_end(tmp_path: Path) -> None:
    done = run_demo(tmp_path, "--accounts", "50", "--commands", "300")
    output = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{output}\n{done.stderr[-5000:]}"
    for line in (
        "opened 50 accounts",
        "300 commands in",
        "every redelivered step re-ran its command with the same command id and stored nothing new",
        "the daemon caught up every projection",
        "money is conserved",
        "every deposit sent over NATS was answered, and stored once",
        "an overdraft over NATS is refused with the aggregate's own error",
        "on SIGTERM the workers drained and exited 0",
        "the read model shows each balance raised by the deposits over NATS",
        "switched account_balances: generation 1 -> 2",
        "the switched-in read model equals a clean replay",
        "downloads the Delta jars from Maven Central",
        "Delta table balances equals the SQLite read model account_balances (after the rebuild)",
        "Delta table balances equals the SQLite read model account_balances (after the incremental update)",
        "DataFrame projection daily_totals equals the SQLite daily rows summed per day (after the incremental update)",
        "account_balances: merge, positions",
        "an update with nothing new changes nothing",
        "account_balances: followed to position",
        "Delta table balances equals the SQLite read model account_balances (after following the stream)",
        "checks passed",
    ):
        assert line in output, f"missing {line!r} in:\n{output}"
    assert "✗" not in output
    history = output[output.index("Delta history of balances"):]
    assert "WRITE" in history and "MERGE" in history, history
    assert (tmp_path / "demo" / "bank.sqlite3").is_file(), "--workdir keeps the outputs"
    assert (tmp_path / "demo" / "delta" / "balances" / "_delta_log").is_dir()
    # A successful demo ends without a traceback (the streaming source's Python process printed one when the
    # follower stopped it mid-call), nor Spark's and py4j's routine messages.
    for noise in ("Traceback", "EOFError", "Truncated the string representation", "Closing down clientserver"):
        assert noise not in done.stderr, done.stderr[-5000:]


def test_the_last_word_never_claims_success_after_a_failed_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A check failed in step 5, then Spark broke: the demo must not say that everything before Spark worked."""
    import samples.demo as demo
    from samples.report import Report

    async def failing_run(args: object, report: Report) -> None:
        report.step("Blue/green rebuild while writing")
        report.check("the switched-in read model equals a clean replay", False, "3 rows differ")
        report.step("Spark: the same projections into Delta Lake")
        raise RuntimeError("the JVM did not start")

    monkeypatch.setattr(demo, "run", failing_run)
    assert demo.main(["--accounts", "5", "--commands", "5"]) == 1
    out = capsys.readouterr().out
    assert "Everything before Spark worked" not in out
    assert "✗ the switched-in read model equals a clean replay (3 rows differ)" in out
    last = [line for line in out.splitlines() if line.strip()][-1]
    assert "The demo failed during step 'Spark: the same projections into Delta Lake'" in last, out

    async def spark_only_fails(args: object, report: Report) -> None:
        report.step("Blue/green rebuild while writing")
        report.check("the switched-in read model equals a clean replay", True)
        report.step("Spark: the same projections into Delta Lake")
        raise RuntimeError("the JVM did not start")

    monkeypatch.setattr(demo, "run", spark_only_fails)
    assert demo.main(["--accounts", "5", "--commands", "5"]) == 1
    assert "Everything before Spark worked" in capsys.readouterr().out


def test_a_failed_check_is_the_demos_last_word(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import samples.demo as demo
    from samples.report import Report

    async def one_check_fails(args: object, report: Report) -> None:
        report.step("Event store")
        report.check("money is conserved", False, "off by 3")

    monkeypatch.setattr(demo, "run", one_check_fails)
    assert demo.main(["--accounts", "5", "--commands", "5"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert "✗ money is conserved (off by 3)" in lines[-2]
    assert "1 of its checks failed" in lines[-1]

"""The CLIs with a server they cannot use: one line on stderr and a failing exit code, within the request timeout."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from eventstore import EmbeddedServer
from projection_helpers import HERE, ROOT, cli
from tests.support.proxy import INFO_LINE, SilentServer

TIMEOUT_S = 1.0
BOUND_S = 2 * TIMEOUT_S + 4  # the request timeout, plus the interpreter's start-up on a loaded machine


async def _run_cli(url: str, tmp_path: Path, *args: str, argv: list[str] | None = None,
                   database: str | None = None) -> tuple[int, list[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_")}
    env.update({
        "NATS_URL": url,
        "JETSOURCING_REQUEST_TIMEOUT_S": str(TIMEOUT_S),
        "JETSOURCING_DATABASE": database or str(tmp_path / "views.sqlite3"),
        "JETSOURCING_POSTGRES_TIMEOUT_S": str(TIMEOUT_S),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
    })
    command = argv or cli(*args)
    # The same command's --help (interpreter, imports; no server) just before: the bound is on the rest, which
    # stays meaningful when a loaded machine takes seconds to start Python.
    startup, _, _ = await _timed(command + ["--help"], env)
    elapsed, code, stderr = await _timed(command, env)
    return code, stderr.decode().splitlines(), elapsed - startup


async def _timed(command: list[str], env: dict[str, str]) -> tuple[float, int, bytes]:
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(60):
            _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return time.monotonic() - started, process.returncode or 0, stderr


COMMANDS = {
    "run-burst": ("run", "projection_examples:AccountBalances", "--until-caught-up"),
    "run": ("run", "projection_examples:AccountBalances"),
    "rebuild": ("rebuild", "projection_examples:AccountBalances"),
    "serve": ("serve", "samples.bank.commands:command_service"),
    "events": ("events", "tail", "--no-follow"),
    "entity": ("entity", "show", "Account", "alice"),
}


@pytest.mark.parametrize("server", ["refused", "silent", "info-then-silent"])
@pytest.mark.parametrize("command", ["run-burst", "rebuild", "serve", "events", "entity"])
async def test_cli_reports_an_unusable_server_in_one_line(tmp_path: Path, server: str, command: str) -> None:
    greeting = INFO_LINE if server == "info-then-silent" else b""
    async with SilentServer(greeting) as silent:
        url = f"nats://127.0.0.1:{EmbeddedServer().port}" if server == "refused" else silent.url
        code, stderr, elapsed = await _run_cli(url, tmp_path, *COMMANDS[command])
    assert code == 1, stderr
    assert len(stderr) == 1 and stderr[0].startswith("jetsourcing: Could not connect to NATS"), stderr
    assert "Traceback" not in stderr[0]
    assert elapsed < BOUND_S, f"took {elapsed:.1f}s"


@pytest.mark.parametrize("database", ["refused", "silent"])
@pytest.mark.parametrize("command", [COMMANDS["run-burst"], COMMANDS["rebuild"], ("status",), ("dead-letters", "list")])
async def test_cli_reports_an_unusable_postgresql_in_one_line(
    nats_url: str, tmp_path: Path, database: str, command: tuple[str, ...]
) -> None:
    async with SilentServer() as silent:
        port = EmbeddedServer().port if database == "refused" else silent.url.rsplit(":", 1)[1]
        url = f"postgresql://u@127.0.0.1:{port}/views?sslmode=disable"
        code, stderr, elapsed = await _run_cli(nats_url, tmp_path, *command, database=url)
    assert code == 1, stderr
    assert len(stderr) == 1 and stderr[0].startswith("jetsourcing: Cannot connect to the read-model database"), stderr
    assert elapsed < BOUND_S + 1, f"took {elapsed:.1f}s"  # libpq waits at least 2 s for a silent server


async def test_cli_debug_adds_the_traceback(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{EmbeddedServer().port}"
    code, stderr, _ = await _run_cli(url, tmp_path, *COMMANDS["run"], "--debug")
    assert code == 1
    assert stderr[0].startswith("Traceback") and stderr[-1].startswith("jetsourcing: Could not connect to NATS")


@pytest.mark.parametrize("server", ["refused", "silent"])
async def test_spark_cli_reports_an_unusable_server_in_one_line_before_starting_spark(tmp_path: Path, server: str) -> None:
    argv = [sys.executable, "-m", "projections.cli", "spark", "update", "projection_examples:Movements",
            "--root", str(tmp_path / "delta")]
    async with SilentServer() as silent:
        url = f"nats://127.0.0.1:{EmbeddedServer().port}" if server == "refused" else silent.url
        code, stderr, elapsed = await _run_cli(url, tmp_path, argv=argv)
    assert code == 1, stderr  # an explained failure, as every command's
    assert len(stderr) == 1 and stderr[0].startswith("jetsourcing: Could not connect to NATS"), stderr
    assert elapsed < BOUND_S + 3, f"took {elapsed:.1f}s"  # + importing pyspark; Spark itself never starts


@pytest.mark.parametrize("command", [(), ("run",), ("rebuild",), ("status",), ("dead-letters",), ("serve",), ("events",), ("events", "tail"),
                                     ("entity",), ("entity", "show"), ("spark",), ("spark", "check"),
                                     ("spark", "fetch-delta-jars"), ("spark", "rebuild"), ("spark", "update")])
def test_every_level_of_help_has_examples(command: tuple[str, ...]) -> None:
    import subprocess

    done = subprocess.run(cli(*command, "--help"), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "example" in done.stdout, done.stdout

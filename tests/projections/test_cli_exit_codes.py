"""One exit-code table for every sub-command: 2 a usage error, 1 a failure, 130 after Ctrl-C; and the options
every command takes are in each one's --help."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from eventstore import EmbeddedServer, EventStore
from projections import ProjectionSettings

from projection_examples import AccountBalances, append_workload, workload
from projection_helpers import burst, cli, cli_env


def _run(settings: ProjectionSettings, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    done = subprocess.run(cli(*args), env={**cli_env(settings), **(env or {})}, capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (("run", "projection_examples:AccountBalances", "--batch-size", "0"), {}),
        (("run", "projection_examples:AccountBalances"), {"JETSOURCING_BATCH_SIZE": "0"}),
        (("rebuild", "projection_examples:AccountBalances", "--batch-size", "0"), {}),
        (("rebuild", "projection_examples:AccountBalances"), {"JETSOURCING_REBUILD_BATCH_SIZE": "0"}),
    ],
    ids=["run-option", "run-environment", "rebuild-option", "rebuild-environment"],
)
def test_a_batch_size_of_0_is_a_usage_error_from_the_option_as_from_the_environment(
    psettings: ProjectionSettings, args: tuple[str, ...], env: dict[str, str]
) -> None:
    code, out, err = _run(psettings, *args, env=env)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "batch_size" in lines[0] and "greater than or equal to 1" in lines[0], (code, err)


@pytest.mark.parametrize("command", [("serve",), ("events", "tail"), ("entity", "show"), ("server",)])
def test_every_command_lists_the_options_every_command_takes(psettings: ProjectionSettings, command: tuple[str, ...]) -> None:
    code, out, err = _run(psettings, *command, "--help")
    assert code == 0, err
    assert "options of every jetsourcing command:" in out
    for option in ("--log-level", "--log-format", "--metrics-port", "--debug"):
        assert option in out, option


async def test_status_with_the_server_down_shows_what_the_read_models_know_and_says_so(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(20, accounts=5))
    await burst([AccountBalances()], psettings, es)
    down = f"nats://127.0.0.1:{EmbeddedServer().port}"  # a free port: nothing listens
    code, out, err = _run(psettings, "status", env={"NATS_URL": down, "JETSOURCING_REQUEST_TIMEOUT_S": "1"})
    lines = err.strip().splitlines()
    assert code == 1, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith(f"jetsourcing: NATS at {down} could not be asked"), err
    assert "account_balances" in out, "the read models' own status is still shown"


def test_spark_without_a_server_says_so_in_the_users_terms(psettings: ProjectionSettings, tmp_path: Path) -> None:
    env = {k: v for k, v in cli_env(psettings).items() if k != "NATS_URL"}
    done = subprocess.run(cli("spark", "rebuild", "projection_examples:Movements", "--root", str(tmp_path / "delta")),
                          env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr  # a failure it explains, as `events tail`'s
    assert lines[0].startswith("jetsourcing: No NATS server is set") and "NATS_URL" in lines[0], lines
    assert "stream_bounds" not in lines[0] and "settings.nats_url needs" not in lines[0]


# Every command and sub-command, and whether its work is to run until stopped (then SIGTERM is its normal stop).
HELP = [((), False), (("run",), True), (("rebuild",), False), (("status",), False), (("dead-letters",), False),
        (("serve",), True), (("server",), True), (("events",), False), (("events", "tail"), False),
        (("entity",), False), (("entity", "show"), False), (("spark",), False), (("spark", "check"), False),
        (("spark", "fetch-delta-jars"), False), (("spark", "rebuild"), False), (("spark", "update"), False),
        (("spark", "follow"), True), (("spark", "status"), False)]


@pytest.mark.parametrize(("command", "runs_until_stopped"), HELP, ids=[" ".join(c) or "jetsourcing" for c, _ in HELP])
def test_every_commands_help_states_the_exit_code_table(command: tuple[str, ...], runs_until_stopped: bool) -> None:
    done = subprocess.run(cli(*command, "--help"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "\nexit codes:\n" in done.stdout, done.stdout
    table = " ".join(done.stdout.split("\nexit codes:\n", 1)[1].split("\n\n", 1)[0].split())
    for entry in ("0 success", "1 failure (the last line on stderr says what is wrong and what to do)",
                  "2 usage error (arguments, settings, import paths)", "130 interrupted by Ctrl-C"):
        assert entry in table, table
    sigterm = "0 also after SIGTERM, its normal stop" if runs_until_stopped else "143 stopped by SIGTERM"
    assert sigterm in table, table

"""``jetsourcing serve``: a command service process that drains on SIGTERM, and its errors in one line."""

from __future__ import annotations

import asyncio
import re
import json
import os
import signal
import socket
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import date
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aggregates import CommandClient, CommandRejectedError, Repository
from eventstore import EventStore
from samples.bank.account import Account
from samples.bank.commands import Deposit, OpenAccount, Withdraw

ROOT = Path(__file__).resolve().parents[2]
DAY = date(2026, 1, 1)


@asynccontextmanager
async def serving(store: EventStore, prefix: str, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``jetsourcing serve samples.bank.commands:command_service`` on the test's stream, started and ready."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_")}
    env.update({"NATS_URL": store.settings.nats_url or "", "JETSOURCING_STREAM": store.settings.stream,
                "JETSOURCING_SUBJECT_PREFIX": store.settings.subject_prefix, "PYTHONPATH": str(ROOT)})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "projections.cli", "serve", "samples.bank.commands:command_service",
        "--command-prefix", prefix, *args, env=env, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        async with asyncio.timeout(30):
            while b"serving " not in (line := await process.stderr.readline()):
                assert line, "the service ended before serving"
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("attempt", range(3))  # a shutdown race hides: try it more than once
async def test_serve_answers_commands_and_sigterm_drains_and_exits_0(store: EventStore, attempt: int) -> None:
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    client = CommandClient(store, subject_prefix=prefix)
    async with serving(store, prefix) as process:
        await client.send(Account, "acc-1", OpenAccount(owner="Ann"))
        sends = [asyncio.create_task(client.send(Account, "acc-1", Deposit(amount=1, value_date=DAY), command_id=f"d{i}"))
                 for i in range(50)]
        await asyncio.sleep(0.01)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            code = await process.wait()
        assert code == 0 and time.monotonic() - started < 5
        assert process.stderr is not None
        said = (await process.stderr.read()).decode()
    done = await asyncio.gather(*sends, return_exceptions=True)
    answered = [r for r in done if not isinstance(r, BaseException)]
    # its summary counts what it answered: the open and the deposits answered ok (those refused in the drain apart)
    assert re.search(rf"stopped: answered [\d,]+ command\(s\) \(.*\bok {len(answered) + 1}\b", said), said
    # What was answered is stored; what was not (sent after the drain began) is not, and resending is safe.
    assert (await Repository(store, Account).get("acc-1")).state.balance == len(answered)


async def test_serve_exits_130_on_ctrl_c(store: EventStore) -> None:
    async with serving(store, f"cmd{uuid.uuid4().hex[:8]}") as process:
        process.send_signal(signal.SIGINT)
        async with asyncio.timeout(10):
            assert await process.wait() == 130


@pytest.mark.parametrize(
    ("factory", "code", "message"),
    [
        ("nope:x", 2, "Cannot import 'nope'"),
        ("samples.bank.commands", 2, "is not an import path"),
        ("samples.bank.commands:Deposit", 1, "raised TypeError"),
        ("tests.aggregates.service_worker:not_a_service", 1, "returned 'not a service', not a CommandService"),
        ("samples.bank.commands:__doc__", 1, "not a function returning a CommandService"),
    ],
)
async def test_serve_errors_are_one_line(store: EventStore, factory: str, code: int, message: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_")}
    env.update({"NATS_URL": store.settings.nats_url or "", "JETSOURCING_STREAM": store.settings.stream,
                "JETSOURCING_SUBJECT_PREFIX": store.settings.subject_prefix, "PYTHONPATH": str(ROOT)})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "projections.cli", "serve", factory, env=env, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(30):
        _, stderr = await process.communicate()
    lines = stderr.decode().splitlines()
    assert process.returncode == code, lines
    assert len(lines) == 1 and lines[0].startswith("jetsourcing: ") and message in lines[0], lines


async def test_serve_settings_are_checked_in_one_line(store: EventStore) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_")}
    env.update({"NATS_URL": store.settings.nats_url or "", "PYTHONPATH": str(ROOT),
                "JETSOURCING_COMMAND_MAX_IN_FLIGHT": "0"})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "projections.cli", "serve", "samples.bank.commands:command_service",
        env=env, stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        _, stderr = await process.communicate()
    text = stderr.decode()
    assert process.returncode == 2 and text.startswith("jetsourcing: invalid setting max_in_flight") and text.count("\n") == 1, text


async def test_serve_logs_json_and_counts_commands_in_its_metrics(store: EventStore) -> None:
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = CommandClient(store, subject_prefix=prefix)
    async with serving(store, prefix, "--log-format", "json", "--metrics-port", str(port)) as process:
        await client.send(Account, "acc-m", OpenAccount(owner="Meg"))
        await client.send(Account, "acc-m", Deposit(amount=5, value_date=DAY))
        with pytest.raises(CommandRejectedError):
            await client.send(Account, "acc-m", Withdraw(amount=6, value_date=DAY))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await process.wait() == 0
        assert process.stderr is not None
        rest = (await process.stderr.read()).decode().splitlines()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    counted = {labels: value for (name, labels), value in samples.items() if name == "jetsourcing_commands_total"}
    assert counted == {
        (("outcome", "ok"), ("subject", f"{prefix}.Account.OpenAccount")): 1.0,
        (("outcome", "ok"), ("subject", f"{prefix}.Account.Deposit")): 1.0,
        (("outcome", "domain"), ("subject", f"{prefix}.Account.Withdraw")): 1.0,
    }
    assert samples[("jetsourcing_command_seconds_count", (("subject", f"{prefix}.Account.Deposit"),))] == 1.0
    assert all(json.loads(line)["level"] for line in rest)  # the log lines after the ready one: JSON too


async def test_a_bad_setting_is_a_usage_error_in_one_line(store: EventStore) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_")}
    env.update({"NATS_URL": store.settings.nats_url or "", "PYTHONPATH": str(ROOT)})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "projections.cli", "serve", "samples.bank.commands:command_service",
        "--max-in-flight", "0", env=env, stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        _, stderr = await process.communicate()
    lines = stderr.decode().splitlines()
    assert process.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("jetsourcing: invalid setting max_in_flight: ") and "(given 0)" in lines[0], lines

"""``jetsourcing events tail`` and ``jetsourcing entity show`` against a real server, in subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from eventstore import EventStore, StreamId

from .events import Deposited, Note, Opened

ROOT = Path(__file__).resolve().parents[2]


def command(store: EventStore, *args: str) -> list[str]:
    return [sys.executable, "-m", "projections.cli", *args, "--nats-url", store.settings.nats_url or "",
            "--stream", store.settings.stream, "--subject-prefix", store.settings.subject_prefix]


async def run(store: EventStore, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *command(store, *args), env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    return process.returncode or 0, out.decode(), err.decode()


async def history(store: EventStore) -> None:
    await store.append(StreamId("Account", "alice"), [Opened(owner="Alice ü")])
    await store.append(StreamId("Account", "bob"), [Opened(owner="Bob")])
    await store.append(StreamId("Account", "alice"), [Deposited(amount=5), Deposited(amount=7)])
    await store.append(StreamId("Memo", "m1"), [Note(text="line one\nline two")])


async def test_entity_show_prints_the_history_with_versions(store: EventStore) -> None:
    await history(store)
    code, out, err = await run(store, "entity", "show", "Account", "alice", "--json")
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    assert [(e["version"], e["type"], e["data"]) for e in events] == [
        (1, "Opened", {"owner": "Alice ü"}), (2, "Deposited", {"amount": 5}), (3, "Deposited", {"amount": 7}),
    ]
    assert events[1]["position"] == events[2]["position"] and (events[1]["index"], events[2]["index"]) == (0, 1)
    code, out, _ = await run(store, "entity", "show", "Account", "alice")
    assert code == 0 and out.startswith("Account/alice: 3 events, version 3") and '"amount": 7' in out


async def test_entity_show_of_nothing_and_of_a_bad_category_are_one_line(store: EventStore) -> None:
    code, out, err = await run(store, "entity", "show", "Account", "nobody")
    assert (code, out) == (1, "") and err.strip().splitlines() == [
        f"jetsourcing: Account/nobody has no events in stream {store.settings.stream!r}."
    ]
    code, _, err = await run(store, "entity", "show", "no spaces allowed", "x")
    assert code == 1 and len(err.splitlines()) == 1 and err.startswith("jetsourcing: Invalid category"), err


async def test_events_tail_filters_by_category_and_entity(store: EventStore) -> None:
    await history(store)
    code, out, err = await run(store, "events", "tail", "--no-follow", "-n", "100", "--json")
    assert code == 0, err
    assert [json.loads(line)["stream"] for line in out.splitlines()] == [
        "Account/alice", "Account/bob", "Account/alice", "Account/alice", "Memo/m1",
    ]
    code, out, _ = await run(store, "events", "tail", "--no-follow", "--category", "Account", "--entity", "bob",
                             "--json")
    assert [json.loads(line)["data"] for line in out.splitlines()] == [{"owner": "Bob"}]
    code, out, _ = await run(store, "events", "tail", "--no-follow", "-n", "1")  # the last position only
    assert out.startswith("#4.0  Memo/m1  v1  Note") and '"text": "line one\\nline two"' in out, out
    code, _, err = await run(store, "events", "tail", "--entity", "bob")
    assert code == 2 and "error: --entity needs exactly one --category" in err, err


async def test_events_tail_n_with_an_entity_counts_the_entitys_events(store: EventStore) -> None:
    await history(store)  # alice: versions 1 (position 1) and 2, 3 (position 3); then bob and a memo
    for _ in range(3):
        await store.append(StreamId("Memo", "m1"), [Note(text="later")])  # positions the entity does not have
    code, out, err = await run(store, "events", "tail", "--no-follow", "--category", "Account", "--entity", "alice",
                               "-n", "2", "--json")
    assert code == 0, err
    assert [json.loads(line)["version"] for line in out.splitlines()] == [2, 3]
    code, out, _ = await run(store, "events", "tail", "--no-follow", "--category", "Account", "--entity", "alice",
                             "-n", "10", "--json")
    assert [json.loads(line)["version"] for line in out.splitlines()] == [1, 2, 3]
    code, out, _ = await run(store, "events", "tail", "--no-follow", "--category", "Account", "--entity", "alice",
                             "-n", "0")
    assert (code, out) == (0, "")


async def test_events_tail_follows_live_until_ctrl_c(store: EventStore) -> None:
    await history(store)
    process = await asyncio.create_subprocess_exec(
        *command(store, "events", "tail", "-n", "0", "--category", "Memo", "--json"),
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        # Appended until the tail shows one: however long its start takes here, it follows from the end it saw.
        assert process.stdout is not None
        reading = asyncio.ensure_future(process.stdout.readline())
        async with asyncio.timeout(60):
            while not reading.done():
                await store.append(StreamId("Memo", "m2"), [Note(text="live")])
                await asyncio.wait([reading], timeout=0.5)
        assert json.loads(reading.result())["data"] == {"text": "live"}
        process.send_signal(signal.SIGINT)
        async with asyncio.timeout(10):
            assert await process.wait() == 130
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("bad", [["-n", "-1"], ["--from-position", "0"], ["--positions", "x"]])
async def test_events_tail_refuses_bad_positions(store: EventStore, bad: list[str]) -> None:
    code, out, err = await run(store, "events", "tail", "--no-follow", *bad)
    assert code == 2 and out == "" and "error:" in err and "Traceback" not in err, err


@pytest.mark.parametrize("args", [("entity", "show", "Account", "a"), ("events", "tail"),
                                  ("serve", "samples.bank.commands:command_service")])
async def test_without_a_server_configured_a_command_says_so_and_starts_none(args: tuple[str, ...]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_") and k != "NATS_URL"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "projections.cli", *args, env={**env, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        _, err = await process.communicate()
    lines = err.decode().splitlines()
    assert process.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("jetsourcing: No NATS server configured: set NATS_URL"), lines


async def test_a_reader_that_stops_early_is_no_error(store: EventStore) -> None:
    await history(store)
    shell = " ".join(f"'{a}'" for a in command(store, "events", "tail", "--no-follow", "-n", "100", "--json"))
    process = await asyncio.create_subprocess_shell(
        f"{shell} | head -1", env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    assert len(out.decode().splitlines()) == 1 and err.decode() == "", err.decode()

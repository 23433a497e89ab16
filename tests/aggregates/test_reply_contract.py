"""The reply contract of commands over NATS at its edges, on a real server: a stored command is never reported as
not stored, every request gets exactly one reply, the client refuses what the server would refuse, a resend gets
the first reply's value, every malformed request is ``invalid``, and a request needs a usable command id."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import pytest
from pydantic import BaseModel

from aggregates import CommandClient, CommandService, InvalidCommandError, Repository
from eventstore import EventStore, StreamId

from .commands import Deposit, Open
from .domain import Account

ID = "Jetsourcing-Command-Id"


class Padded(BaseModel):
    """Deposits 1; ``padding`` only makes the request as large as a test needs."""

    padding: str


class Returning(BaseModel):
    """Deposits 1 and returns the value named by ``kind``."""

    kind: str
    size: int = 0


class SlowDeposit(BaseModel):
    amount: int
    seconds: float


class Sleep(BaseModel):
    seconds: float


def _value(kind: str, size: int) -> Any:
    if kind == "digest":
        return b"\xff\xfe\x00\x9c"  # bytes that are not UTF-8, as a hash's digest is
    if kind == "cycle":
        cycle: dict[str, Any] = {}
        cycle["self"] = cycle
        return cycle
    if kind == "nan":
        return float("nan")
    if kind == "huge_int":
        return 10**5000  # more digits than int->str converts
    if kind == "object":
        return object()
    return "x" * size


def build_service(store: EventStore, prefix: str) -> CommandService:
    accounts = Repository(store, Account)
    service = CommandService(store, subject_prefix=prefix)
    service.add(accounts, Open, lambda a, c: a.open(c.owner), create=True)
    service.add(accounts, Deposit, lambda a, c: a.deposit(c.amount))
    service.add(accounts, Padded, lambda a, c: a.deposit(1))
    service.add(accounts, Sleep, lambda a, c: None)

    @service.command(accounts, Returning)
    def returning(account: Account, command: Returning) -> Any:
        account.deposit(1)
        return _value(command.kind, command.size)

    @service.command(accounts, SlowDeposit)
    async def slow_deposit(account: Account, command: SlowDeposit) -> int:
        await asyncio.sleep(command.seconds)
        return account.deposit(command.amount)

    return service


@pytest.fixture
async def served(store: EventStore, prefix: str) -> AsyncIterator[CommandService]:
    async with build_service(store, prefix) as service:
        yield service


async def balance(store: EventStore, account: str) -> tuple[int, int]:
    got = await Repository(store, Account, cache_size=0).get(account)
    return got.version, got.state.balance


# -- 1. a stored command is never reported as not stored ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["digest", "cycle", "nan", "huge_int", "object"])
async def test_a_stored_command_whose_value_cannot_be_sent_is_answered_ok(
    served: CommandService, client: CommandClient, store: EventStore, kind: str
) -> None:
    await client.send(Account, "ann", Open(owner="Ann"))
    reply = await client.send(Account, "ann", Returning(kind=kind), command_id=f"r-{kind}")
    assert (reply.version, reply.duplicate, reply.value) == (2, False, None)
    assert reply.value_error is not None and "cannot be sent as JSON" in reply.value_error
    assert "the command is stored" in reply.value_error
    again = await client.send(Account, "ann", Returning(kind=kind), command_id=f"r-{kind}")
    assert (again.version, again.duplicate, again.value) == (2, True, None)
    assert again.value_error is not None and "cannot be sent as JSON" in again.value_error
    assert await balance(store, "ann") == (2, 1)


# -- 2. every request gets exactly one reply ------------------------------------------------------------------------


async def test_a_value_over_max_payload_is_answered_ok_without_it(
    served: CommandService, client: CommandClient, store: EventStore
) -> None:
    limit = store.nc.max_payload
    await client.send(Account, "ben", Open(owner="Ben"))
    reply = await client.send(Account, "ben", Returning(kind="text", size=limit), command_id="big-value")
    assert (reply.version, reply.value) == (2, None)
    assert reply.value_error is not None and f"max_payload allows {limit:,}" in reply.value_error
    again = await client.send(Account, "ben", Returning(kind="text", size=limit), command_id="big-value")
    assert (again.version, again.duplicate, again.value) == (2, True, None)
    assert again.value_error is not None and "kept for a resend" in again.value_error
    # A value just small enough to keep comes back to a resend whole.
    kept = await client.send(Account, "ben", Returning(kind="text", size=4000), command_id="kept-value")
    resent = await client.send(Account, "ben", Returning(kind="text", size=4000), command_id="kept-value")
    assert kept.value == resent.value == "x" * 4000 and resent.duplicate and resent.value_error is None
    assert await balance(store, "ben") == (3, 2)


# -- 3. the client refuses what the server would refuse -------------------------------------------------------------


def sent_size(aggregate_id: str, command: BaseModel, headers: dict[str, str]) -> int:
    """What the server counts against max_payload: the header block nats-py writes, and the body."""
    block = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n"
    body = json.dumps({"aggregate_id": aggregate_id, "command": command.model_dump(mode="json")}).encode()
    return len(block) + len(body)


async def test_the_client_refuses_a_request_over_max_payload_counting_its_headers(
    served: CommandService, client: CommandClient, store: EventStore
) -> None:
    limit = store.nc.max_payload
    await client.send(Account, "cy", Open(owner="Cy"))
    headers = {ID: "padded-1", "Jetsourcing-Correlation-Id": "a-correlation-id"}
    padding = limit - sent_size("cy", Padded(padding=""), headers)
    at_limit = Padded(padding="p" * padding)
    assert sent_size("cy", at_limit, headers) == limit
    reply = await client.send(Account, "cy", at_limit, command_id="padded-1", correlation_id="a-correlation-id")
    assert reply.version == 2
    over = Padded(padding="p" * (padding + 1))
    with pytest.raises(InvalidCommandError, match=f"takes {limit + 1:,} bytes as sent.*at most {limit:,}.*Nothing was sent"):
        await client.send(Account, "cy", over, command_id="padded-2", correlation_id="a-correlation-id")
    # Refused before sending: the connection (shared with the store) stays up and serves what follows.
    assert store.nc.is_connected
    assert (await client.send(Account, "cy", Deposit(amount=5))).version == 3
    assert await balance(store, "cy") == (3, 6)


# -- 4. a resend gets the first reply's value -----------------------------------------------------------------------


async def test_a_resend_after_a_lost_reply_gets_the_first_runs_value(
    served: CommandService, client: CommandClient, store: EventStore, prefix: str
) -> None:
    await client.send(Account, "dee", Open(owner="Dee"))
    # The first send's reply goes to an inbox nobody reads: lost.
    body = json.dumps({"aggregate_id": "dee", "command": {"amount": 5}}).encode()
    await store.nc.publish(f"{prefix}.Account.Deposit", body, reply=f"_INBOX.lost{uuid.uuid4().hex}", headers={ID: "dep-5"})
    async with asyncio.timeout(10):
        while (await balance(store, "dee"))[0] < 2:
            await asyncio.sleep(0.02)
    await client.send(Account, "dee", Deposit(amount=7))
    again = await client.send(Account, "dee", Deposit(amount=5), command_id="dep-5")
    assert (again.duplicate, again.version, again.value) == (True, 2, 5)  # the balance after the first run, not 12
    # A worker that never saw the command (nothing cached) answers the same.
    async with build_service(store, prefix):
        for _ in range(4):
            resent = await client.send(Account, "dee", Deposit(amount=5), command_id="dep-5")
            assert (resent.duplicate, resent.version, resent.value) == (True, 2, 5)
    assert await balance(store, "dee") == (3, 12)


async def test_two_callers_with_one_id_both_get_the_first_runs_value(
    store: EventStore, prefix: str, client: CommandClient
) -> None:
    # Two workers in the queue group, each with its own repository and cache: the two sends race on either.
    async with build_service(store, prefix), build_service(store, prefix):
        await client.send(Account, "eve", Open(owner="Eve"))
        for round_ in range(6):
            command = SlowDeposit(amount=round_ + 1, seconds=0.05)
            replies = await asyncio.gather(*(client.send(Account, "eve", command, command_id=f"race-{round_}")
                                             for _ in range(2)))
            assert sorted(r.duplicate for r in replies) == [False, True]
            assert replies[0].value == replies[1].value == sum(range(1, round_ + 2))
            assert replies[0].version == replies[1].version == round_ + 2
    assert await balance(store, "eve") == (7, 21)


async def test_a_repository_race_on_one_command_id_returns_the_stored_note(store: EventStore) -> None:
    await Repository(store, Account).execute("fin", lambda a: a.open("Fin"), create=True)
    loaded = asyncio.Event()
    waiting = 0

    async def deposit(account: Account) -> int:
        nonlocal waiting
        waiting += 1
        if waiting == 2:
            loaded.set()
        await loaded.wait()  # both have loaded version 1 before either appends
        return account.deposit(3)

    results = await asyncio.gather(*(
        Repository(store, Account).execute("fin", deposit, command_id="same", note=lambda v: f"balance {v}")
        for _ in range(2)
    ))
    assert sorted(r.duplicate for r in results) == [False, True]
    assert [r.note for r in results] == ["balance 3", "balance 3"] and results[0].version == results[1].version == 2
    assert await balance(store, "fin") == (2, 3)


# -- 5. every malformed request is invalid --------------------------------------------------------------------------


MALFORMED = [
    b"[" * 200_000,  # nested past the parser's recursion limit
    b'{"aggregate_id": "x", "command": ' + b"[" * 200_000,
    b'{"aggregate_id": "x", "command": {"amount": ' + b"[" * 5_000 + b"]" * 5_000 + b"}}",
    b'{"aggregate_id": "\xff\xfe", "command": {"amount": 1}}',  # not UTF-8
    b'"a string"', b"5", b"null", b"[1, 2]",  # not an object
    b'{"aggregate_id": "x", "command": {"amount": 1' + b"0" * 5_000 + b"}}",  # more digits than int() takes
    b'{"aggregate_id": "x", "command": {"seconds": 1e999}}',  # a float out of range: infinity
    b'{"aggregate_id": "x", "command": {"seconds": NaN}}', b'{"aggregate_id": "x", "command": {"seconds": -Infinity}}',
    b'{"aggregate_id": "x\\ud800", "command": {"seconds": 0}}',  # a lone surrogate
]


async def test_every_malformed_request_is_invalid_without_a_traceback(
    served: CommandService, client: CommandClient, store: EventStore, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    await client.send(Account, "x", Open(owner="X"))
    with caplog.at_level(logging.WARNING, logger="aggregates.service"):
        for i, body in enumerate(MALFORMED):
            subject = f"{prefix}.Account.{'Sleep' if b'seconds' in body else 'Deposit'}"
            msg = await store.nc.request(subject, body, timeout=5, headers={ID: f"bad-{i}"})
            reply = json.loads(msg.data)
            assert (reply["ok"], reply["error"]) == (False, "invalid"), (body[:80], reply)
            assert reply["message"]
    assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
    assert await balance(store, "x") == (1, 0)


# -- 6. a request needs a usable command id -------------------------------------------------------------------------


async def raw_request(nats_url: str, subject: str, header_lines: bytes, body: bytes) -> dict[str, Any]:
    """Send one request over a plain socket, with header bytes nats-py could not send (invalid UTF-8); its reply."""
    url = urlparse(nats_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        async with asyncio.timeout(5):
            await reader.readline()  # INFO
            inbox = f"_INBOX.raw{uuid.uuid4().hex}"
            block = b"NATS/1.0\r\n" + header_lines + b"\r\n"
            writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n'
                         + f"SUB {inbox} 1\r\n".encode()
                         + f"HPUB {subject} {inbox} {len(block)} {len(block) + len(body)}\r\n".encode()
                         + block + body + b"\r\n")
            await writer.drain()
            while True:
                line = await reader.readline()
                if line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
                elif line.startswith(b"MSG "):
                    data = await reader.readexactly(int(line.split()[-1]) + 2)
                    return dict(json.loads(data[:-2]))
                elif line.startswith((b"-ERR", b"HMSG")):
                    raise AssertionError(line)
    finally:
        writer.close()


async def test_two_command_ids_of_invalid_utf8_are_refused_not_taken_for_one(
    served: CommandService, client: CommandClient, store: EventStore, prefix: str, nats_url: str
) -> None:
    await client.send(Account, "gil", Open(owner="Gil"))
    body = json.dumps({"aggregate_id": "gil", "command": {"amount": 1}}).encode()
    for raw_id in (b"\xff\x01id", b"\xfe\x01id"):
        reply = await raw_request(nats_url, f"{prefix}.Account.Deposit", ID.encode() + b": " + raw_id + b"\r\n", body)
        assert (reply["ok"], reply["error"]) == (False, "invalid"), reply
        assert "not valid UTF-8" in reply["message"] and f"Set the {ID} header" in reply["message"]
    # The same raw sender with a valid id is served: only the id was wrong.
    reply = await raw_request(nats_url, f"{prefix}.Account.Deposit", ID.encode() + b": ok-id\r\n", body)
    assert (reply["ok"], reply["version"]) == (True, 2)
    assert await balance(store, "gil") == (2, 1)


@pytest.mark.parametrize(
    ("headers", "problem"),
    [(None, "has no"), ({}, "has no"), ({ID: ""}, "is empty"), ({ID: "   "}, "is empty"),
     ({"Jetsourcing-Command-Idx": "a"}, "has no"), ({ID: "a", ID.lower(): "b"}, "twice")],
)
async def test_a_request_without_a_usable_command_id_is_refused(
    served: CommandService, client: CommandClient, store: EventStore, prefix: str,
    headers: dict[str, str] | None, problem: str,
) -> None:
    await client.send(Account, "hal", Open(owner="Hal"))
    body = json.dumps({"aggregate_id": "hal", "command": {"amount": 1}}).encode()
    for _ in range(2):
        reply = json.loads((await store.nc.request(f"{prefix}.Account.Deposit", body, timeout=5, headers=headers)).data)
        assert (reply["ok"], reply["error"]) == (False, "invalid"), reply
        assert problem in reply["message"] and "Nothing ran" in reply["message"]
    assert await balance(store, "hal") == (1, 0)


async def test_the_command_id_header_is_read_in_any_case_and_keeps_its_idempotency(
    served: CommandService, client: CommandClient, store: EventStore, prefix: str
) -> None:
    await client.send(Account, "ivy", Open(owner="Ivy"))
    body = json.dumps({"aggregate_id": "ivy", "command": {"amount": 4}}).encode()
    replies = [
        json.loads((await store.nc.request(f"{prefix}.Account.Deposit", body, timeout=5, headers={name: "lower"})).data)
        for name in (ID.lower(), ID.upper(), ID)
    ]
    assert [(r["ok"], r["version"], r["duplicate"], r["value"]) for r in replies] == [
        (True, 2, False, 4), (True, 2, True, 4), (True, 2, True, 4)
    ]
    assert await balance(store, "ivy") == (2, 4)

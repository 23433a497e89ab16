"""CommandService and CommandClient: commands over NATS request-reply, in a queue group, on a real server."""

from __future__ import annotations

import asyncio
import logging
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from aggregates import (
    AggregateExistsError,
    AggregateNotFoundError,
    CommandClient,
    CommandConflictError,
    CommandError,
    CommandFailedError,
    CommandRejectedError,
    CommandService,
    CommandUnavailableError,
    DomainError,
    InvalidCommandError,
    Repository,
    RetryPolicy,
)
from eventstore import EmbeddedServer, EventStore, EventStoreSettings, InvalidArgumentError, StreamId

from tests.conftest import unique_settings
from tests.support.freeze import frozen

from .conftest import RawPublish

from .commands import Deposit, Open
from .domain import Account


class Withdraw(BaseModel):
    amount: int


class Slow(BaseModel):
    seconds: float


class Boom(BaseModel):
    pass


def build_service(store: EventStore, prefix: str, **options: Any) -> CommandService:
    """The bank's commands; ``Slow`` sleeps inside the handler before depositing 1."""
    accounts = Repository(store, Account)
    service = CommandService(store, subject_prefix=prefix, **options)
    service.add(accounts, Open, lambda a, c: a.open(c.owner), create=True)
    service.add(accounts, Deposit, lambda a, c: a.deposit(c.amount))
    service.add(accounts, Withdraw, lambda a, c: a.withdraw(c.amount))

    @service.command(accounts, Slow)
    async def slow(account: Account, command: Slow) -> int:
        await asyncio.sleep(command.seconds)
        return account.deposit(1)

    @service.command(accounts, Boom)
    def boom(account: Account, command: Boom) -> None:
        raise RuntimeError("a bug in the handler")

    return service


@pytest.fixture
async def served(store: EventStore, prefix: str) -> AsyncIterator[CommandService]:
    async with build_service(store, prefix) as service:
        yield service


async def test_a_command_runs_and_replies_with_its_version_and_position(
    served: CommandService, client: CommandClient, store: EventStore, prefix: str
) -> None:
    assert f"{prefix}.Account.Deposit" in served.subjects
    opened = await client.send(Account, "alice", Open(owner="Alice"))
    deposited = await client.send("Account", "alice", Deposit(amount=7))
    assert (opened.version, deposited.version, deposited.value, deposited.duplicate) == (1, 2, 7, False)
    assert deposited.position == (await store.state(StreamId("Account", "alice"))).position
    assert (await Repository(store, Account).get("alice")).state.balance == 7


async def test_a_resent_command_id_runs_once(served: CommandService, client: CommandClient, store: EventStore) -> None:
    await client.send(Account, "bob", Open(owner="Bob"))
    first = await client.send(Account, "bob", Deposit(amount=5), command_id="deposit-1")
    again = await client.send(Account, "bob", Deposit(amount=5), command_id="deposit-1")
    assert (again.duplicate, again.version, again.position) == (True, first.version, first.position)
    assert (await Repository(store, Account).get("bob")).state.balance == 5


async def test_errors_map_to_the_same_types_on_the_callers_side(served: CommandService, client: CommandClient) -> None:
    await client.send(Account, "carol", Open(owner="Carol"))
    with pytest.raises(CommandRejectedError, match="balance is only 0") as refused:
        await client.send(Account, "carol", Withdraw(amount=1))
    assert isinstance(refused.value, DomainError) and refused.value.error_type == "InsufficientFunds"
    with pytest.raises(AggregateNotFoundError, match="nobody"):
        await client.send(Account, "nobody", Deposit(amount=1))
    with pytest.raises(CommandFailedError, match="RuntimeError: a bug in the handler"):
        await client.send(Account, "carol", Boom())
    with pytest.raises(InvalidCommandError, match="not a valid Deposit"):
        await client.send(Account, "carol", Open(owner="Carol"), name="Deposit")  # not the model served there


async def test_a_creating_command_for_an_existing_aggregate_is_refused_over_nats(
    served: CommandService, client: CommandClient, store: EventStore, prefix: str
) -> None:
    await client.send(Account, "erin", Open(owner="Erin"), command_id="open-erin")
    again = await client.send(Account, "erin", Open(owner="Erin"), command_id="open-erin")  # a resend
    assert again.duplicate and again.version == 1
    with pytest.raises(AggregateExistsError, match=r"Account 'erin' exists already \(version 1\)") as refused:
        await client.send(Account, "erin", Open(owner="Mallory"))
    assert (refused.value.aggregate, refused.value.aggregate_id) == ("Account", "erin")
    assert await store.version(StreamId("Account", "erin")) == 1
    # A route that creates or updates runs on the aggregate as it is: here the aggregate's own invariant refuses.
    upsert = CommandService(store, subject_prefix=f"{prefix}u")
    upsert.add(Repository(store, Account), Open, lambda a, c: a.open(c.owner), create=True, exist_ok=True)
    async with upsert:
        with pytest.raises(CommandRejectedError, match="already open"):
            await CommandClient(store, subject_prefix=f"{prefix}u").send(Account, "erin", Open(owner="Mallory"))
    with pytest.raises(InvalidArgumentError, match="pass create=True with it"):
        upsert.add(Repository(store, Account), Deposit, lambda a, c: a.deposit(c.amount), exist_ok=True)


async def test_a_command_that_fails_on_the_service_side_is_logged_there(
    served: CommandService, client: CommandClient, raw_publish: RawPublish, caplog: pytest.LogCaptureFixture
) -> None:
    await client.send(Account, "fay", Open(owner="Fay"))
    with caplog.at_level(logging.ERROR, logger="aggregates.service"):
        with pytest.raises(CommandFailedError, match="RuntimeError: a bug in the handler"):
            await client.send(Account, "fay", Boom())
        await raw_publish(StreamId("Account", "zed"), "Opened", 1, b'{"owner": 5}', 1)  # stored, but not an Opened
        with pytest.raises(CommandFailedError, match="zed"):
            await client.send(Account, "zed", Deposit(amount=1))
    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failed) == 2, [r.getMessage() for r in caplog.records]
    assert failed[0].exc_info is not None and "Boom" in failed[0].getMessage()  # the bug, with its traceback
    assert "Deposit" in failed[1].getMessage() and "zed" in failed[1].getMessage()


async def test_a_command_nobody_serves_is_unavailable_at_once(client: CommandClient) -> None:
    started = time.monotonic()
    with pytest.raises(CommandUnavailableError, match="No service serves") as unavailable:
        await client.send(Account, "dave", Deposit(amount=1))
    assert time.monotonic() - started < 2
    assert "private" not in str(unavailable.value)  # a shared server: nothing more to say


async def test_a_client_on_a_private_embedded_server_is_told_so_when_nobody_serves(tmp_path: Any) -> None:
    settings = EventStoreSettings(nats_url=None, storage_dir=tmp_path, stream="PRIVATE", subject_prefix="private")
    async with EventStore.connect(settings) as store:  # no NATS_URL: a server of its own
        with pytest.raises(CommandUnavailableError, match="No service serves") as unavailable:
            await CommandClient(store).send(Account, "dave", Deposit(amount=1))
    assert "private embedded server that no service can reach (no NATS_URL was set)" in str(unavailable.value)
    assert "`jetsourcing server`" in str(unavailable.value)


async def test_malformed_requests_get_an_error_reply_and_the_service_goes_on(
    served: CommandService, client: CommandClient, store: EventStore, prefix: str
) -> None:
    subject = f"{prefix}.Account.Deposit"
    for body in (b"", b"not json", b"[]", b'{"aggregate_id": 5, "command": {}}', b'{"aggregate_id": "x"}',
                 b'{"aggregate_id": "x", "command": {"amount": "lots"}}', b'{"aggregate_id": "", "command": {"amount": 1}}',
                 json.dumps({"aggregate_id": "a\x00b", "command": {"amount": 1}}).encode(), b"\xff\xfe"):
        reply = json.loads((await store.nc.request(subject, body, timeout=5)).data)
        assert (reply["ok"], reply["error"]) == (False, "invalid"), (body, reply)
        assert reply["message"]
    await client.send(Account, "erin", Open(owner="Erin"))
    assert (await client.send(Account, "erin", Deposit(amount=2))).version == 2


async def test_a_slow_handler_against_a_client_timeout(served: CommandService, client: CommandClient, store: EventStore) -> None:
    await client.send(Account, "frank", Open(owner="Frank"))
    started = time.monotonic()
    with pytest.raises(CommandUnavailableError, match="command_id='slow-1'") as timed_out:
        await client.send(Account, "frank", Slow(seconds=1.5), command_id="slow-1", timeout_s=0.3)
    assert time.monotonic() - started < 1.0
    assert isinstance(timed_out.value, CommandError)
    # The command ran anyway; resending it with its id reports that run instead of running it again.
    await asyncio.sleep(1.5)
    again = await client.send(Account, "frank", Slow(seconds=1.5), command_id="slow-1")
    assert again.duplicate and again.version == 2
    assert (await Repository(store, Account).get("frank")).state.balance == 1


async def test_a_conflict_after_every_retry_is_a_conflict_error(store: EventStore, prefix: str, client: CommandClient) -> None:
    accounts = Repository(store, Account, cache_size=0, retry=RetryPolicy(attempts=2, base_delay_s=0))
    other = Repository(store, Account)
    service = CommandService(store, subject_prefix=prefix)
    service.add(accounts, Open, lambda a, c: a.open(c.owner), create=True)

    async def racing_deposit(account: Account, command: Deposit) -> int:
        await other.execute(account.id, lambda a: a.deposit(1))  # another writer gets in first, every time
        return account.deposit(command.amount)

    service.add(accounts, Deposit, racing_deposit)
    async with service:
        await client.send(Account, "gina", Open(owner="Gina"))
        with pytest.raises(CommandConflictError, match="gave up after 2 attempts"):
            await client.send(Account, "gina", Deposit(amount=5))
    assert (await Repository(store, Account).get("gina")).state.balance == 2  # only the racing writer's


async def test_every_request_is_handled_by_exactly_one_member_of_the_queue_group(
    store: EventStore, prefix: str, client: CommandClient
) -> None:
    handled: list[int] = []
    services = []
    for member in range(3):
        accounts = Repository(store, Account)
        service = CommandService(store, subject_prefix=prefix, routing=False)  # the queue group's own sharing
        service.add(accounts, Open, lambda a, c: a.open(c.owner), create=True)

        def deposit(account: Account, command: Deposit, member: int = member) -> int:
            handled.append(member)
            return account.deposit(command.amount)

        service.add(accounts, Deposit, deposit)
        services.append(service)
        await service.start()
    try:
        ids = [f"q{i}" for i in range(20)]
        await asyncio.gather(*(client.send(Account, i, Open(owner=i)) for i in ids))
        replies = await asyncio.gather(*(client.send(Account, ids[n % 20], Deposit(amount=1)) for n in range(200)))
    finally:
        for service in services:
            await service.stop()
    # A handler runs again after a conflict with another member, so count effects, not calls.
    assert set(handled) == {0, 1, 2}
    assert not any(r.duplicate for r in replies) and len({(r.position) for r in replies}) == 200
    balances = [(await Repository(store, Account).get(i)).state.balance for i in ids]
    assert balances == [10] * 20


async def test_stop_lets_commands_in_flight_finish_and_reply(store: EventStore, prefix: str, client: CommandClient) -> None:
    service = build_service(store, prefix)
    await service.start()
    await client.send(Account, "hank", Open(owner="Hank"))
    pending = asyncio.create_task(client.send(Account, "hank", Slow(seconds=0.5)))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await service.stop()
    assert 0.2 < time.monotonic() - started < 3
    assert (await pending).version == 2
    with pytest.raises(CommandUnavailableError):
        await client.send(Account, "hank", Deposit(amount=1))


async def test_stop_ends_within_its_drain_timeout(store: EventStore, prefix: str, client: CommandClient) -> None:
    service = build_service(store, prefix, drain_timeout_s=0.5)
    await service.start()
    await client.send(Account, "ivy", Open(owner="Ivy"))
    pending = asyncio.create_task(client.send(Account, "ivy", Slow(seconds=30), timeout_s=10))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    await service.stop()
    assert time.monotonic() - started < 2.5
    with pytest.raises(CommandUnavailableError, match="stopped before the command finished"):
        await pending  # answered at the stop, not after the client's 10 s
    assert time.monotonic() - started < 2.5
    assert (await Repository(store, Account).get("ivy")).version == 1  # the cancelled command stored nothing


@pytest.mark.parametrize(
    "options",
    [
        {"subject_prefix": ""}, {"subject_prefix": "cmd.*"}, {"subject_prefix": "a b"}, {"subject_prefix": "cmd."},
        {"subject_prefix": 5}, {"queue": "two words"}, {"queue": ""}, {"max_in_flight": 0}, {"max_in_flight": True},
        {"max_in_flight": 1.5}, {"drain_timeout_s": 0}, {"drain_timeout_s": "10"}, {"drain_timeout_s": float("nan")},
    ],
)
async def test_service_options_are_checked(store: EventStore, options: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        CommandService(store, **options)


async def test_service_registrations_are_checked(store: EventStore, prefix: str) -> None:
    service = CommandService(store, subject_prefix=prefix)
    accounts = Repository(store, Account)
    for bad in (
        {"repository": store}, {"model": dict}, {"model": Deposit(amount=1)}, {"handler": "deposit"},
        {"name": "has space"}, {"name": "Deposit.Now"}, {"name": "*"}, {"name": "x" * 65}, {"create": 1},
    ):
        args: dict[str, Any] = {"repository": accounts, "model": Deposit, "handler": lambda a, c: None, **bad}
        with pytest.raises(InvalidArgumentError):
            service.add(args.pop("repository"), args.pop("model"), args.pop("handler"), **args)
    service.add(accounts, Deposit, lambda a, c: None)
    with pytest.raises(InvalidArgumentError, match="served already"):
        service.add(accounts, Deposit, lambda a, c: None)
    with pytest.raises(InvalidArgumentError, match="no commands"):
        await CommandService(store).start()


@pytest.mark.parametrize(
    "call",
    [
        {"aggregate": int}, {"aggregate": "has space"}, {"aggregate_id": ""}, {"aggregate_id": 5},
        {"command": {"amount": 1}}, {"name": "a.b"}, {"command_id": ""}, {"command_id": "line\nbreak"},
        {"command_id": " padded"}, {"command_id": 7}, {"correlation_id": "\x00"}, {"timeout_s": 0},
        {"timeout_s": -1}, {"timeout_s": float("inf")}, {"timeout_s": True},
    ],
)
async def test_client_arguments_are_checked_before_sending(client: CommandClient, call: dict[str, Any]) -> None:
    args: dict[str, Any] = {"aggregate": Account, "aggregate_id": "alice", "command": Deposit(amount=1), **call}
    with pytest.raises(InvalidArgumentError):
        await client.send(args.pop("aggregate"), args.pop("aggregate_id"), args.pop("command"), **args)


def test_client_options_are_checked(store: EventStore) -> None:
    for bad in ({"subject_prefix": "a..b"}, {"timeout_s": 0}, {"timeout_s": "5"}):
        with pytest.raises(InvalidArgumentError):
            CommandClient(store, **bad)
    with pytest.raises(InvalidArgumentError):
        CommandClient("nats://localhost:4222")  # type: ignore[arg-type]


async def test_odd_but_legal_ids_travel_unchanged(served: CommandService, client: CommandClient, store: EventStore) -> None:
    odd = "ünïcødé/with spaces & dots.and:colons"
    await client.send(Account, odd, Open(owner="Odd"), command_id="ïd-ü 1", correlation_id="corr ü")
    again = await client.send(Account, odd, Open(owner="Odd"), command_id="ïd-ü 1")
    assert again.duplicate
    events = await store.read(StreamId("Account", odd))
    assert [(e.idempotency_key, e.correlation_id) for e in events] == [("ïd-ü 1", "corr ü")]


async def test_a_worker_killed_mid_command_loses_and_doubles_nothing_when_clients_resend(
    nats_url: str, prefix: str
) -> None:
    """Three worker processes in one queue group; one is SIGKILLed while commands run. Clients resend a command
    that got no answer with the same command id: every deposit is applied exactly once. SIGTERM then drains the
    other two, which exit 0 within seconds."""
    settings = unique_settings(nats_url)
    async with EventStore.connect(settings) as store:
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.aggregates.service_worker", nats_url, settings.stream,
                 settings.subject_prefix, prefix],
                stdout=subprocess.PIPE, text=True,
            )
            for _ in range(3)
        ]
        try:
            for worker in workers:
                assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
            client = CommandClient(store, subject_prefix=prefix, timeout_s=2)
            ids = [f"k{i}" for i in range(10)]
            await asyncio.gather(*(client.send(Account, i, Open(owner=i)) for i in ids))
            resent = 0
            answered = 0
            slots = asyncio.Semaphore(32)

            async def deposit(n: int) -> None:
                nonlocal resent, answered
                async with slots:
                    for _ in range(20):
                        try:
                            await client.send(Account, ids[n % 10], Deposit(amount=1), command_id=f"d{n}")
                            answered += 1
                            return
                        except CommandUnavailableError:
                            resent += 1
                    raise AssertionError(f"command d{n} never got an answer")

            async def kill_when_busy() -> None:
                while answered < 100:
                    await asyncio.sleep(0.005)
                workers[0].kill()

            await asyncio.gather(kill_when_busy(), *(deposit(n) for n in range(400)))
            assert workers[0].wait(5) == -signal.SIGKILL
            balances = [(await Repository(store, Account).get(i)).state.balance for i in ids]
            assert balances == [40] * 10, (balances, resent)
            assert resent > 0  # the kill did cut commands off: they were answered only on a resend
            keys = [e.idempotency_key async for batch in store.read_all() for e in batch if e.type == "Deposited"]
            assert sorted(keys) == sorted(f"d{n}" for n in range(400))
            started = time.monotonic()
            for worker in workers[1:]:
                worker.send_signal(signal.SIGTERM)
            assert [w.wait(10) for w in workers[1:]] == [0, 0]
            assert time.monotonic() - started < 8
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()


async def test_a_command_at_the_servers_size_limit(served: CommandService, client: CommandClient, store: EventStore) -> None:
    class Big(BaseModel):
        owner: str

    limit = store.nc.max_payload
    with pytest.raises(InvalidCommandError, match=f"at most {limit:,}"):
        await client.send(Account, "big", Big(owner="x" * limit), name="Open")
    # Just under the limit the request goes out; the event store refuses the commit it would make, in the reply.
    with pytest.raises(InvalidCommandError, match="more than the server's max_payload"):
        await client.send(Account, "big", Big(owner="x" * (limit - 200)), name="Open")
    assert await store.read(StreamId("Account", "big")) == []


async def test_commands_queued_past_the_drain_deadline_are_answered_at_once(
    store: EventStore, prefix: str, client: CommandClient
) -> None:
    service = build_service(store, prefix, max_in_flight=1, drain_timeout_s=0.5)
    await service.start()
    await client.send(Account, "jay", Open(owner="Jay"))
    sends = [asyncio.create_task(client.send(Account, "jay", Slow(seconds=30), timeout_s=20)) for _ in range(3)]
    await asyncio.sleep(0.3)  # one runs, two wait for the slot
    started = time.monotonic()
    await service.stop()
    done = await asyncio.gather(*sends, return_exceptions=True)
    assert time.monotonic() - started < 3
    messages = sorted(str(e) for e in done)
    assert all(isinstance(e, CommandUnavailableError) for e in done), done
    assert sum("before the command finished" in m for m in messages) == 1, messages
    assert sum("before this command started" in m for m in messages) == 2, messages
    assert (await Repository(store, Account).get("jay")).version == 1


async def test_a_uuid_id_is_sent_as_its_text(served: CommandService, client: CommandClient, store: EventStore) -> None:
    key = uuid.uuid4()
    await client.send(Account, key, Open(owner="Kim"))
    assert (await Repository(store, Account).get(str(key))).state.owner == "Kim"


@pytest.fixture(scope="module")
def server_to_freeze() -> Iterator[EmbeddedServer]:
    """A server of this module's own: freezing the session's would stall other users of it."""
    with EmbeddedServer() as server:
        yield server


async def test_a_stop_while_the_server_is_frozen_leaves_the_stores_connection_working(
    server_to_freeze: EmbeddedServer, prefix: str
) -> None:
    # stop() gives up on its drains (their flushes) after drain_timeout_s; the PONGs the server sends once it
    # thaws must not break the store's connection, which serves again at once.
    async with await EventStore.connect(unique_settings(server_to_freeze.url, request_timeout_s=2.0)) as store:
        service = build_service(store, prefix, drain_timeout_s=0.5, routing=False)
        await service.start()
        async with frozen(server_to_freeze):
            started = time.monotonic()
            await service.stop()
            assert time.monotonic() - started < 2.5
        async with build_service(store, prefix, routing=False):
            client = CommandClient(store, subject_prefix=prefix, timeout_s=2)
            assert (await client.send(Account, "kim", Open(owner="Kim"))).version == 1

"""Reactors against a real nats-server: shared work, retries, dead letters, crashes, start positions, idempotency."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel

from eventstore import (
    NO_STREAM,
    EmbeddedServer,
    EventStore,
    EventStoreSettings,
    RecordedEvent,
    ServerUnavailableError,
    StreamId,
)
from projections import (
    DeadLetterReason,
    PoisonEvent,
    Reactor,
    ReactorConfigError,
    ReactorHandler,
    ReactorStart,
    ReactorStats,
    ReactorStatus,
    ReactorWorker,
    format_reactor_status,
    read_reactor_dead_letters,
    read_reactor_status,
    run_reactor,
)

REPO = Path(__file__).resolve().parents[2]


class Ordered(BaseModel):
    n: int


class TransferRequested(BaseModel):
    to: str
    amount: int


class Credited(BaseModel):
    amount: int
    transfer: str


MODELS = (Ordered, TransferRequested, Credited)


def register(store: EventStore) -> EventStore:
    for model in MODELS:
        store.registry.register(model)
    return store


@pytest.fixture
def store(store: EventStore) -> EventStore:
    return register(store)


@asynccontextmanager
async def connections(settings: EventStoreSettings, count: int) -> AsyncIterator[list[EventStore]]:
    """``count`` more event stores on the same stream, each with a NATS connection of its own (like separate workers)."""
    stores = [register(await EventStore.connect(settings)) for _ in range(count)]
    try:
        yield stores
    finally:
        for s in stores:
            await s.close()


async def append_numbered(store: EventStore, numbers: range, category: str = "Order") -> list[int]:
    """Append one ``Ordered`` event per number, each to its own entity; return the positions."""
    positions: list[int] = []
    chunk = 200
    for start in range(numbers.start, numbers.stop, chunk):
        batch = range(start, min(start + chunk, numbers.stop))
        results = await asyncio.gather(
            *(store.append(StreamId(category, f"o{n}"), [Ordered(n=n)], NO_STREAM) for n in batch)
        )
        positions.extend(r.position for r in results)
    return positions


async def consumer_info(store: EventStore, name: str) -> dict[str, object]:
    reply = await store.nc.request(f"$JS.API.CONSUMER.INFO.{store.settings.stream}.{name}", b"", timeout=5)
    info: dict[str, object] = json.loads(reply.data)
    return info


# -- shared work ----------------------------------------------------------------


def reactor_metrics(name: str) -> dict[str, float]:
    """The reactor's counters in this process's Prometheus registry (they add up across tests: compare deltas)."""
    return {
        kind: REGISTRY.get_sample_value(f"jetsourcing_reactor_{kind}_total", {"reactor": name}) or 0.0
        for kind in ("deliveries", "redeliveries", "dead_letters")
    }


async def test_three_workers_share_3000_events_and_none_is_lost(store: EventStore) -> None:
    await append_numbered(store, range(3000))
    seen: list[Counter[int]] = [Counter(), Counter(), Counter()]

    def handler_for(worker: int) -> ReactorHandler:
        async def handle(event: RecordedEvent) -> None:
            await asyncio.sleep(0.002)  # some I/O, so the work is worth spreading
            seen[worker][event.data.n] += 1  # type: ignore[attr-defined]

        return handle

    async with connections(store.settings, 3) as stores:
        workers = [
            ReactorWorker(s, Reactor("spread", handler=handler_for(i), ack_wait_s=5), concurrency=8, until_idle=True,
                          name=f"w{i}")
            for i, s in enumerate(stores)
        ]
        started = time.monotonic()
        stats = await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 30)
        elapsed = time.monotonic() - started

    union = Counter[int]()
    for c in seen:
        union.update(c)
    assert set(union) == set(range(3000)), "every event is handled at least once"
    spread = [sum(c.values()) for c in seen]
    duplicates = sum(union.values()) - 3000
    print(f"\nspread over 3 workers: {spread}, duplicates: {duplicates}, {elapsed:.2f} s")
    assert all(n >= 300 for n in spread), f"work is shared: {spread}"
    assert [s.handled for s in stats] == spread
    info = await consumer_info(store, "spread")
    assert (info["num_pending"], info["num_ack_pending"]) == (0, 0)


# -- retries and dead letters -------------------------------------------------------


async def test_a_handler_that_fails_twice_is_retried_and_the_commit_is_acked_once_all_its_events_succeed(
    store: EventStore,
) -> None:
    await store.append(StreamId("Order", "multi"), [Ordered(n=1), Ordered(n=2)], NO_STREAM)
    calls: Counter[int] = Counter()

    async def flaky(event: RecordedEvent) -> None:
        n = event.data.n  # type: ignore[attr-defined]
        calls[n] += 1
        if n == 2 and calls[n] <= 2:
            raise ConnectionError("mail server unavailable")

    reactor = Reactor("flaky", handler=flaky, max_deliver=5, retry_backoff_s=[0.05, 0.1], ack_wait_s=2)
    before = reactor_metrics("flaky")
    stats = await asyncio.wait_for(run_reactor(store, reactor, until_idle=True), 15)
    after = reactor_metrics("flaky")
    assert {k: after[k] - before[k] for k in after} == {"deliveries": 3, "redeliveries": 2, "dead_letters": 0}

    assert calls[2] == 3, "delivered three times: two failures, then success"
    assert calls[1] == 3, "the commit is retried whole: its first event is handled again (at-least-once)"
    assert (stats.retried, stats.redelivered, stats.handled, stats.dead_lettered) == (2, 2, 2, 0)
    assert await read_reactor_dead_letters(store, "flaky") == []


async def test_failing_and_poison_events_land_in_the_dead_letter_stream_with_the_reason(store: EventStore) -> None:
    positions = await append_numbered(store, range(6))
    handled: list[int] = []
    attempts: Counter[int] = Counter()

    async def handle(event: RecordedEvent) -> None:
        n = event.data.n  # type: ignore[attr-defined]
        attempts[n] += 1
        if n == 2:
            raise ValueError(f"cannot ship order {n}\nsecond line")
        if n == 4:
            raise PoisonEvent(f"order {n} refers to a customer that never existed")
        handled.append(n)

    reactor = Reactor("shipper", handler=handle, max_deliver=3, retry_backoff_s=[0.05], ack_wait_s=2)
    before = reactor_metrics("shipper")
    stats = await asyncio.wait_for(run_reactor(store, reactor, until_idle=True, concurrency=4), 15)
    assert reactor_metrics("shipper")["dead_letters"] - before["dead_letters"] == 2
    [status] = await read_reactor_status(store)
    assert status == ReactorStatus("shipper", pending=0, ack_pending=0, redelivered=0, dead_letters=2)
    table = format_reactor_status([status]).splitlines()
    assert table[0].split() == ["reactor", "pending", "in", "flight", "redelivered", "dead", "letters"]
    assert table[1].split() == ["shipper", "0", "0", "0", "2"]

    assert sorted(handled) == [0, 1, 3, 5], "failing events do not hold the others up"
    assert attempts[2] == 3 and attempts[4] == 1
    assert (stats.dead_lettered, stats.retried) == (2, 2)
    letters = {d.position: d for d in await read_reactor_dead_letters(store, "shipper")}
    assert set(letters) == {positions[2], positions[4]}

    failed = letters[positions[2]]
    assert failed.reason is DeadLetterReason.MAX_DELIVER
    assert failed.deliveries == 3
    assert failed.error == "ValueError: cannot ship order 2 second line"
    assert failed.subject == StreamId("Order", "o2").subject(store.settings.subject_prefix)
    assert [e.data for e in failed.events] == [Ordered(n=2)]
    assert failed.events[0].position == positions[2]
    assert failed.dead_lettered_at <= datetime.now(timezone.utc)

    poison = letters[positions[4]]
    assert (poison.reason, poison.deliveries) == (DeadLetterReason.POISON, 1)
    assert poison.error == "PoisonEvent: order 4 refers to a customer that never existed"
    assert poison.headers["Es-Type"] == "Ordered"

    info = await consumer_info(store, "shipper")
    assert (info["num_pending"], info["num_ack_pending"]) == (0, 0), "dead letters are terminated, not pending"
    # Running the reactor again hands nothing out: terminated events are never delivered again.
    again = await asyncio.wait_for(run_reactor(store, reactor, until_idle=True), 10)
    assert (again.handled, again.redelivered, again.dead_lettered) == (0, 0, 0)


class LastDelivery:
    """A reactor allowed one delivery, whose first worker hangs on the event until it is cancelled."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.holding = asyncio.Event()

    def reactor(self, handler: Callable[[RecordedEvent], Any]) -> Reactor:
        return Reactor(self.name, handler=handler, max_deliver=1, ack_wait_s=1.0)

    async def hang(self, event: RecordedEvent) -> None:
        self.holding.set()
        await asyncio.sleep(60)

    @staticmethod
    async def never(event: RecordedEvent) -> None:
        raise AssertionError("max_deliver=1: the event must not be delivered again")

    async def doomed_worker(self, store: EventStore) -> asyncio.Future[ReactorStats]:
        """A worker that holds the event's only delivery (await :meth:`cancel` to let it die without a verdict)."""
        doomed = asyncio.ensure_future(ReactorWorker(store, self.reactor(self.hang)).run())
        await asyncio.wait_for(self.holding.wait(), 10)
        return doomed

    @staticmethod
    async def cancel(doomed: asyncio.Future[ReactorStats]) -> None:
        doomed.cancel()  # the handler is cancelled on its last delivery: no verdict
        with pytest.raises(asyncio.CancelledError):
            await doomed

    async def dead_letters_of(self, worker: ReactorWorker, store: EventStore) -> tuple[list[Any], ReactorStats]:
        """Run ``worker`` until the dead letter appears (10 s at most); its dead letters and its counters."""
        running = asyncio.ensure_future(worker.run())
        deadline = time.monotonic() + 10
        while not (letters := await read_reactor_dead_letters(store, self.name)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        worker.stop()
        return letters, await asyncio.wait_for(running, 10)


async def test_an_event_whose_worker_dies_on_its_last_delivery_is_dead_lettered_by_another_worker(
    store: EventStore,
) -> None:
    await append_numbered(store, range(1))
    last = LastDelivery("last")
    async with connections(store.settings, 2) as (first, second):
        doomed = await last.doomed_worker(first)
        survivor = ReactorWorker(second, last.reactor(last.never))
        asyncio.get_running_loop().call_later(0.2, doomed.cancel)  # once the survivor has subscribed
        letters, stats = await last.dead_letters_of(survivor, store)
        with pytest.raises(asyncio.CancelledError):
            await doomed

    (letter,) = letters
    assert (letter.reason, letter.deliveries) == (DeadLetterReason.MAX_DELIVER, 1)
    assert "no verdict" in letter.error
    assert [e.data for e in letter.events] == [Ordered(n=0)]
    assert stats.dead_lettered == 1


async def test_a_lone_worker_that_dies_on_the_last_delivery_leaves_it_to_the_next_worker_to_start(
    store: EventStore,
) -> None:
    await append_numbered(store, range(1))
    lone = LastDelivery("lone")
    async with connections(store.settings, 2) as (first, second):
        await lone.cancel(await lone.doomed_worker(first))  # the only worker goes away during the last delivery
        await asyncio.sleep(2.5)  # no worker at all for longer than ack_wait
        assert await read_reactor_dead_letters(store, "lone") == []
        # The server sends the max-deliveries advisory when it next has a pull request to
        # serve, so the next worker to start receives it.
        letters, stats = await lone.dead_letters_of(ReactorWorker(second, lone.reactor(lone.never)), store)

    (letter,) = letters
    assert (letter.reason, letter.deliveries, stats.dead_lettered) == (DeadLetterReason.MAX_DELIVER, 1, 1)
    assert "no verdict" in letter.error


# -- crashes and long work -------------------------------------------------------------

CHILD = """
import asyncio, json, sys
from eventstore import EventStore, EventStoreSettings
from projections import Reactor, run_reactor

async def main() -> None:
    settings = EventStoreSettings(**json.loads(sys.argv[1]))
    store = await EventStore.connect(settings)

    async def hold(event):
        print("got", event.event_id, flush=True)
        await asyncio.sleep(3600)

    await run_reactor(store, Reactor("crashy", handler=hold, ack_wait_s=1.5), concurrency=5)

asyncio.run(main())
"""


async def test_events_of_a_killed_worker_are_redelivered_to_the_others_after_ack_wait(store: EventStore) -> None:
    await append_numbered(store, range(20))
    settings = {k: getattr(store.settings, k) for k in ("nats_url", "stream", "subject_prefix")}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, json.dumps(settings), cwd=REPO, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    held: set[str] = set()
    try:
        assert child.stdout is not None
        while len(held) < 5:
            line = await asyncio.wait_for(child.stdout.readline(), 20)
            assert line, "the child worker exited early"
            held.add(line.decode().split()[1])
    finally:
        child.send_signal(signal.SIGKILL)  # no nak, no ack, no goodbye
        await child.wait()
    killed_at = time.monotonic()

    handled_at: dict[str, float] = {}

    async def handle(event: RecordedEvent) -> None:
        handled_at.setdefault(event.event_id, time.monotonic())

    async with connections(store.settings, 2) as stores:
        workers = [ReactorWorker(s, Reactor("crashy", handler=handle, ack_wait_s=1.5), concurrency=4, until_idle=True)
                   for s in stores]
        await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 20)

    all_ids = {e.event_id async for batch in store.read_all() for e in batch}
    assert set(handled_at) == all_ids, "the other workers handle every event, including the five the dead one held"
    assert held <= set(handled_at)
    # The dead worker's last heartbeat was at most ~0.4 * ack_wait before the kill: the server then waited ack_wait.
    assert all(handled_at[i] - killed_at >= 0.5 for i in held), [handled_at[i] - killed_at for i in held]
    assert sum(w.stats.redelivered for w in workers) == 5


async def test_a_long_handler_keeps_its_event_with_heartbeats_and_stop_finishes_it(store: EventStore) -> None:
    await append_numbered(store, range(1))
    calls: list[str] = []
    started = asyncio.Event()

    def slow(worker: str) -> ReactorHandler:
        async def handle(event: RecordedEvent) -> None:
            calls.append(worker)
            started.set()
            await asyncio.sleep(2.0)  # four times ack_wait

        return handle

    async with connections(store.settings, 2) as (a, b):
        workers = [ReactorWorker(s, Reactor("slow", handler=slow(n), ack_wait_s=0.5)) for s, n in ((a, "a"), (b, "b"))]
        runs = [asyncio.ensure_future(w.run()) for w in workers]
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.sleep(0.2)
        for w in workers:
            w.stop()  # graceful: the handler in hand finishes and is acknowledged
        stats = await asyncio.wait_for(asyncio.gather(*runs), 10)

    assert len(calls) == 1, "heartbeats kept the event from being handed to the other worker"
    assert sum(s.handled for s in stats) == 1 and sum(s.redelivered for s in stats) == 0
    info = await consumer_info(store, "slow")
    assert (info["num_pending"], info["num_ack_pending"], info["num_redelivered"]) == (0, 0, 0)


# -- start positions ------------------------------------------------------------------


async def test_a_consumer_created_without_the_reactor_mark_gets_it_and_shows_in_status(store: EventStore) -> None:
    await append_numbered(store, range(3))
    async def ignore(event: RecordedEvent) -> None:
        pass

    reactor = Reactor("older", handler=ignore)
    config = reactor.consumer_config(store)
    del config["metadata"]  # as a release before the mark created it
    created = await store.durable_consumer("older").create(config)
    assert created.error is None, created.description
    assert await read_reactor_status(store) == []
    async with asyncio.timeout(15):
        stats = await run_reactor(store, reactor, until_idle=True)
    assert stats.handled == 3
    assert await read_reactor_status(store) == [ReactorStatus("older", 0, 0, 0, 0)]


async def test_start_positions_all_new_from_position_and_from_time(store: EventStore) -> None:
    positions = await append_numbered(store, range(0, 4))  # 0..3
    await asyncio.sleep(0.05)
    since = datetime.now(timezone.utc)
    await asyncio.sleep(0.05)
    positions += await append_numbered(store, range(4, 6))  # 4, 5

    got: dict[str, list[int]] = {}

    def reactor(name: str, start: ReactorStart, max_deliver: int = 5) -> Reactor:
        async def handle(event: RecordedEvent) -> None:
            got.setdefault(name, []).append(event.data.n)  # type: ignore[attr-defined]

        return Reactor(name, handler=handle, start=start, ack_wait_s=2, max_deliver=max_deliver)

    await ReactorWorker(store, reactor("new", ReactorStart.new())).setup()  # "new" counts from here
    positions += await append_numbered(store, range(6, 8))  # 6, 7

    reactors = [
        reactor("all", ReactorStart.all()),
        reactor("new", ReactorStart.new()),
        reactor("from-position", ReactorStart.from_position(positions[3])),
        reactor("from-time", ReactorStart.from_time(since)),
    ]
    await asyncio.wait_for(asyncio.gather(*(run_reactor(store, r, until_idle=True) for r in reactors)), 15)
    assert {k: sorted(v) for k, v in got.items()} == {
        "all": list(range(8)),
        "new": [6, 7],
        "from-position": [3, 4, 5, 6, 7],
        "from-time": [4, 5, 6, 7],
    }

    # An existing reactor resumes where it is: a changed start does not rewind it, changed retry settings apply.
    got.clear()
    await append_numbered(store, range(8, 9))
    changed = reactor("all", ReactorStart.from_position(1), max_deliver=7)
    await asyncio.wait_for(run_reactor(store, changed, until_idle=True), 10)
    assert got == {"all": [8]}
    config = (await consumer_info(store, "all"))["config"]
    assert isinstance(config, dict)
    assert (config["deliver_policy"], config["max_deliver"]) == ("all", 7)


# -- idempotent effects -----------------------------------------------------------------


async def test_commands_issued_by_a_reactor_are_idempotent_under_redelivery(store: EventStore) -> None:
    for i in range(10):
        await store.append(StreamId("Transfer", f"t{i}"), [TransferRequested(to=f"acc{i % 3}", amount=i + 1)], NO_STREAM)
    deliveries: Counter[str] = Counter()
    duplicates: list[bool] = []

    def credit_transfers(worker: EventStore) -> Reactor:
        """A process manager: each TransferRequested becomes a Credited command on the target account."""

        async def credit(event: RecordedEvent) -> None:
            request = event.data
            assert isinstance(request, TransferRequested)
            result = await worker.append(
                StreamId("Account", request.to),
                [Credited(amount=request.amount, transfer=event.stream_id.entity_id)],
                idempotency_key=reactor.idempotency_key(event),  # "credit-transfers:<event id>"
            )
            duplicates.append(result.duplicate)
            deliveries[event.event_id] += 1
            if deliveries[event.event_id] == 1:
                raise TimeoutError("crashed after issuing the command, before the acknowledgement")

        reactor = Reactor("credit-transfers", handler=credit, categories=["Transfer"], retry_backoff_s=[0.05],
                          ack_wait_s=2)
        return reactor

    async with connections(store.settings, 2) as stores:
        workers = [ReactorWorker(s, credit_transfers(s), concurrency=3, until_idle=True) for s in stores]
        await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 15)

    assert sorted(deliveries.values()) == [2] * 10, "every transfer was delivered twice"
    assert duplicates.count(True) == 10 and duplicates.count(False) == 10, "the second command stored nothing"
    credits = [e for i in range(3) for e in await store.read(StreamId("Account", f"acc{i}"))]
    assert sorted((e.data.transfer, e.data.amount) for e in credits) == sorted(  # type: ignore[attr-defined]
        (f"t{i}", i + 1) for i in range(10)
    ), "each transfer credited exactly once"


async def test_handlers_by_event_type_and_categories(store: EventStore) -> None:
    await store.append(StreamId("Order", "o1"), [Ordered(n=1), Credited(amount=5, transfer="x")], NO_STREAM)
    await store.append(StreamId("Transfer", "t1"), [TransferRequested(to="a", amount=3)], NO_STREAM)
    await store.append(StreamId("Account", "a"), [Credited(amount=3, transfer="t1")], NO_STREAM)
    got: list[tuple[str, str]] = []

    async def on_ordered(event: RecordedEvent) -> None:
        got.append(("ordered", str(event.stream_id)))

    async def on_transfer(event: RecordedEvent) -> None:
        got.append(("transfer", str(event.stream_id)))

    reactor = Reactor("typed", handlers={Ordered: on_ordered, "TransferRequested": on_transfer},
                      categories=["Order", "Transfer"], ack_wait_s=2)
    stats = await asyncio.wait_for(run_reactor(store, reactor, until_idle=True), 10)
    assert sorted(got) == [("ordered", "Order/o1"), ("transfer", "Transfer/t1")]
    assert (stats.handled, stats.skipped) == (2, 1), "the Credited in Order/o1 has no handler; Account is filtered out"

    class Unregistered(BaseModel):
        x: int

    with pytest.raises(ReactorConfigError, match="not registered"):
        await ReactorWorker(store, Reactor("bad", handlers={Unregistered: on_ordered})).setup()


async def test_a_worker_rides_out_a_server_restart(tmp_path: Path) -> None:
    with EmbeddedServer(tmp_path / "nats") as server:
        store = register(await EventStore.connect(EventStoreSettings(nats_url=server.url, stream="R", subject_prefix="r")))
        try:
            await append_numbered(store, range(50))
            seen: Counter[int] = Counter()

            async def handle(event: RecordedEvent) -> None:
                await asyncio.sleep(0.01)
                seen[event.data.n] += 1  # type: ignore[attr-defined]

            worker = ReactorWorker(store, Reactor("survivor", handler=handle, ack_wait_s=1), concurrency=4,
                                   pull_expires_s=1.0)
            running = asyncio.ensure_future(worker.run())
            while len(seen) < 10:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(server.restart)
            while not store.nc.is_connected:
                await asyncio.sleep(0.05)
            await append_numbered(store, range(50, 100))
            deadline = time.monotonic() + 20
            while set(seen) != set(range(100)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            worker.stop()
            await asyncio.wait_for(running, 10)
            assert set(seen) == set(range(100)), sorted(set(range(100)) - set(seen))
        finally:
            await store.close()


async def test_a_worker_ends_with_server_unavailable_once_an_outage_outlasts_the_limit(tmp_path: Path) -> None:
    """outage_limit_s: past it without the server the worker ends (before: it retried its pulls for ever)."""
    with EmbeddedServer(tmp_path / "nats") as server:
        settings = EventStoreSettings(nats_url=server.url, stream="R", subject_prefix="r", outage_limit_s=1.5)
        store = register(await EventStore.connect(settings))
        try:
            await append_numbered(store, range(5))
            seen: list[int] = []

            async def handle(event: RecordedEvent) -> None:
                seen.append(event.data.n)  # type: ignore[attr-defined]

            worker = ReactorWorker(store, Reactor("limited", handler=handle, ack_wait_s=1), pull_expires_s=1.0)
            running = asyncio.ensure_future(worker.run())
            while len(seen) < 5:
                await asyncio.sleep(0.01)
            server.stop()
            stopped = time.monotonic()
            with pytest.raises(ServerUnavailableError, match="outage limit"):
                async with asyncio.timeout(30):
                    await running
            assert time.monotonic() - stopped < 15
        finally:
            await store.close()


# -- definitions ----------------------------------------------------------------------------


async def _noop(event: RecordedEvent) -> None:
    return None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "has.dot", "handler": _noop}, "Invalid reactor name"),
        ({"name": "r"}, "has no handler"),
        ({"name": "r", "handler": _noop, "max_deliver": 0}, "max_deliver must be"),
        ({"name": "r", "handler": _noop, "retry_backoff_s": []}, "retry_backoff_s must hold"),
        ({"name": "r", "handler": _noop, "ack_wait_s": 0.01}, "ack_wait_s must be"),
        ({"name": "r", "handler": _noop, "categories": ["no spaces"]}, "Invalid category"),
    ],
)
def test_invalid_reactor_definitions_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ReactorConfigError, match=message):
        Reactor(**kwargs)  # type: ignore[arg-type]


def test_start_and_retry_schedule() -> None:
    with pytest.raises(ReactorConfigError, match="timezone-aware"):
        ReactorStart.from_time(datetime(2026, 1, 1))
    with pytest.raises(ReactorConfigError, match=">= 1"):
        ReactorStart.from_position(0)
    reactor = Reactor("r", handler=_noop, retry_backoff_s=[1, 5])
    assert [reactor.retry_delay_s(n) for n in (1, 2, 3, 9)] == [1.0, 5.0, 5.0, 5.0]
    event = RecordedEvent(1, 0, StreamId("A", "1"), 1, "T", 1, "abc", b"{}", "")
    assert reactor.idempotency_key(event) == "r:abc"
    assert reactor.idempotency_key(event, "refund") == "r:abc:refund"

"""eventstore.tasks: background tasks that always stop; retries that back off and log by state, not by attempt."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from eventstore import Backoff, EmbeddedServer, EventStore, EventStoreSettings, Outage, ride_out, stop_task


async def _swallows(times: int | list[int], ended: list[str]) -> None:
    """Loses the first ``times`` cancellations (``[n]``: changeable), as asyncio.wait_for can on Python 3.11."""
    limit = times if isinstance(times, list) else [times]
    lost = 0
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            lost += 1
            if lost > limit[0]:
                ended.append("cancelled")
                raise


async def test_stop_task_re_sends_a_swallowed_cancellation() -> None:
    ended: list[str] = []
    task = asyncio.create_task(_swallows(3, ended))
    await asyncio.sleep(0)
    started = time.monotonic()
    assert await stop_task(task, timeout_s=5)
    assert task.cancelled() and ended == ["cancelled"]
    assert time.monotonic() - started < 1.0


async def test_stop_task_is_bounded_for_a_task_that_ignores_cancellation(caplog: pytest.LogCaptureFixture) -> None:
    ended: list[str] = []
    limit = [10**9]
    task = asyncio.create_task(_swallows(limit, ended), name="stubborn")
    await asyncio.sleep(0)
    started = time.monotonic()
    assert not await stop_task(task, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - started < 1.0
    assert "stubborn" in caplog.text
    limit[0] = 0  # let it end, or the event loop's teardown would wait for it forever
    task.cancel()
    await asyncio.wait({task})


async def test_stop_task_lets_a_task_end_by_its_own_flag_and_never_raises_its_outcome() -> None:
    flag = asyncio.Event()

    async def polite() -> None:
        await flag.wait()
        raise ValueError("the task's own failure")

    task = asyncio.create_task(polite())
    await asyncio.sleep(0)
    flag.set()
    assert await stop_task(task, grace_s=1.0, timeout_s=2.0)
    assert not task.cancelled() and isinstance(task.exception(), ValueError)


async def test_stop_task_passes_the_callers_cancellation_on_after_cancelling_the_task() -> None:
    ended: list[str] = []
    task = asyncio.create_task(_swallows(0, ended))
    stopper = asyncio.create_task(stop_task(task, grace_s=5.0, timeout_s=10.0))
    await asyncio.sleep(0.05)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    await asyncio.sleep(0)
    assert task.cancelled() and ended == ["cancelled"]


def test_backoff_grows_with_jitter_to_its_cap_and_resets_on_success() -> None:
    backoff = Backoff("thing", logging.getLogger("test"), first_s=0.1, cap_s=1.0)
    delays = [backoff.failed("down") for _ in range(12)]
    steps = [min(0.1 * 2**i, 1.0) for i in range(12)]
    assert all(step / 2 <= d <= step for d, step in zip(delays, steps)), delays
    assert len(set(delays)) > 6  # jittered, not in lock step
    backoff.succeeded()
    assert 0.05 <= backoff.failed("down") <= 0.1


def test_an_outage_is_logged_once_when_it_starts_then_as_reminders_and_once_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "test")
    outage = Outage("the thing", logging.getLogger("test"), remind_s=0.2)
    for _ in range(50):
        outage.failed(ConnectionError("refused"))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "the thing failed (refused)" in warnings[0].getMessage()
    time.sleep(0.25)
    outage.failed(TimeoutError())
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and "still failing" in warnings[1].getMessage() and "TimeoutError" in warnings[1].getMessage()
    outage.succeeded()
    outage.succeeded()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"the thing works again after {caplog.records[-1].args[1]:.1f} s (51 failed attempts)."  # type: ignore[index]
    ]


async def test_a_server_outage_is_logged_once_not_per_reconnect_attempt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = EmbeddedServer(tmp_path).start()
    try:
        store = await EventStore.connect(EventStoreSettings(nats_url=server.url, stream="T", subject_prefix="t"))
        try:
            caplog.clear()
            caplog.set_level(logging.INFO, "jetsourcing.eventstore")
            server.stop()
            await asyncio.sleep(2.0)  # about ten reconnect attempts
            server.start()
            async with asyncio.timeout(20):
                while not store.nc.is_connected:
                    await asyncio.sleep(0.05)
        finally:
            await store.close()
    finally:
        server.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 2, warnings  # the failure (and the disconnect), not one line per attempt
    assert any("works again" in r.getMessage() for r in caplog.records)


class _Flaky:
    """Fails with ``error`` the first ``failures`` times it is called, then answers its call count."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.calls


def _is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionError)


async def test_ride_out_waits_out_transient_failures_and_logs_the_outage_twice(caplog: pytest.LogCaptureFixture) -> None:
    call = _Flaky(5, ConnectionError("refused"))
    with caplog.at_level(logging.DEBUG, logger="test.outage"):
        result = await ride_out(call, what="the database", logger=logging.getLogger("test.outage"),
                                transient=_is_connection_error, limit_s=None, first_s=0.001, cap_s=0.002)
    assert result == 6 and call.calls == 6
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 2, lines
    assert "the database failed (refused); retrying." in lines[0]
    assert "works again" in lines[1] and "5 failed attempts" in lines[1]


async def test_ride_out_raises_a_failure_that_is_not_transient_at_once() -> None:
    call = _Flaky(5, ValueError("bad input"))
    with pytest.raises(ValueError, match="bad input"):
        await ride_out(call, what="x", logger=logging.getLogger("test.outage"), transient=_is_connection_error,
                       limit_s=None, first_s=0.001)
    assert call.calls == 1


async def test_ride_out_gives_up_at_the_outage_limit_with_the_last_failure(caplog: pytest.LogCaptureFixture) -> None:
    call = _Flaky(10**6, ConnectionError("still down"))
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="test.outage"), pytest.raises(ConnectionError, match="still down"):
        await ride_out(call, what="the server", logger=logging.getLogger("test.outage"),
                       transient=_is_connection_error, limit_s=0.3, first_s=0.01, cap_s=10.0)
    took = time.monotonic() - started
    assert 0.3 <= took < 2.0, took  # the backoff's delay is cut at the limit, not slept past it
    assert call.calls > 2
    assert any("outage limit" in r.getMessage() for r in caplog.records)


async def test_ride_out_stops_during_a_backoff_when_asked() -> None:
    call = _Flaky(10**6, ConnectionError("down"))
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stop.set)
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        await ride_out(call, what="x", logger=logging.getLogger("test.outage"), transient=_is_connection_error,
                       limit_s=None, stop=stop, first_s=30.0, cap_s=30.0)
    assert time.monotonic() - started < 2.0
    assert call.calls == 1

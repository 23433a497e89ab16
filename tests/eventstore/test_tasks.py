"""eventstore.tasks: background tasks that always stop; retries that back off and log by state, not by attempt."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from eventstore import Backoff, EmbeddedServer, EventStore, EventStoreSettings, Outage, stop_task


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

"""Starting while JetStream says "not now": a long-running start waits it out, a stop or the outage limit ends the
wait, a one-shot start fails in time; JetStream's "not now" answers are told apart from its refusals."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from nats.errors import ConnectionClosedError
from nats.js.errors import APIError, BadRequestError, NotFoundError

from eventstore import AuthenticationError, EventStore, EventStoreClosedError, EventStoreSettings, ServerUnavailableError, StorageError, StreamId
from eventstore.errors import map_nats_error, server_unavailable
from eventstore.jetstream import ErrorCode, not_now, ride_out_jetstream

from ..conftest import unique_settings
from tests.support.proxy import Proxy

from .events import Deposited

TIMEOUT_S = 0.5


async def test_a_long_running_start_waits_while_every_reply_is_lost(nats_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async with Proxy(nats_url) as proxy:
        proxy.drop_replies(1.0)
        settings = unique_settings(proxy.url, request_timeout_s=TIMEOUT_S)
        with caplog.at_level(logging.INFO, logger="jetsourcing.eventstore"):
            connecting = asyncio.ensure_future(EventStore.connect(settings, long_running=True))
            await asyncio.sleep(2.5)  # several attempts, each given up after request_timeout_s
            assert not connecting.done(), connecting
            proxy.drop_replies(0.0)
            async with asyncio.timeout(10):
                store = await connecting
        try:
            store.registry.register(Deposited)
            assert (await store.append(StreamId("Account", "a"), [Deposited(amount=1)])).position == 1
        finally:
            await store.close()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "jetsourcing.eventstore"]
    warnings = [m for level, m in lines if level >= logging.WARNING]
    # Logged by state: one warning when the wait starts (not one per attempt), one line when it is over.
    assert len(warnings) == 1 and warnings[0].startswith(f"Checking stream '{settings.stream}' failed"), lines
    assert any(m.startswith(f"Checking stream '{settings.stream}' works again") for _, m in lines), lines


async def test_a_stop_ends_the_wait_within_a_moment(nats_url: str) -> None:
    async with Proxy(nats_url) as proxy:
        proxy.drop_replies(1.0)
        stop = asyncio.Event()
        settings = unique_settings(proxy.url, request_timeout_s=5.0)
        connecting = asyncio.ensure_future(EventStore.connect(settings, long_running=True, stop=stop))
        await asyncio.sleep(1.0)  # inside the first attempt, which would wait 5 s
        stop.set()
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="stopped"):
            async with asyncio.timeout(10):
                await connecting
        assert time.monotonic() - started < 1.5


async def test_the_outage_limit_ends_the_wait(nats_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async with Proxy(nats_url) as proxy:
        proxy.drop_replies(1.0)
        settings = unique_settings(proxy.url, request_timeout_s=TIMEOUT_S, outage_limit_s=1.5)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="jetsourcing.eventstore"):
            with pytest.raises(ServerUnavailableError, match=f"Reading the settings of stream '{settings.stream}'"):
                async with asyncio.timeout(20):
                    await EventStore.connect(settings, long_running=True)
        # The limit, plus the attempt under way when it passed.
        assert 1.5 <= time.monotonic() - started < 1.5 + 3 * TIMEOUT_S + 1.5
    assert any("the outage limit (outage_limit_s); giving up" in r.getMessage() for r in caplog.records)


async def test_a_one_shot_start_gives_up_after_one_attempt(nats_url: str) -> None:
    async with Proxy(nats_url) as proxy:
        proxy.drop_replies(1.0)
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="did not answer within 0.5s"):
            await EventStore.connect(unique_settings(proxy.url, request_timeout_s=TIMEOUT_S))
        assert time.monotonic() - started < 2 * TIMEOUT_S + 1.0


def _mapped(exc: Exception) -> BaseException:
    """What :func:`map_nats_error` makes of nats-py's ``exc``."""
    try:
        with map_nats_error("Opening bucket 'b'", 1.0):
            raise exc
    except Exception as mapped:  # noqa: BLE001 - the point
        return mapped
    raise AssertionError("map_nats_error swallowed the error")


@pytest.mark.parametrize("code", [ErrorCode.NO_SUITABLE_PEERS, ErrorCode.JETSTREAM_UNAVAILABLE,
                                  ErrorCode.CLUSTER_CANNOT_HANDLE, ErrorCode.STREAM_OFFLINE, ErrorCode.CONSUMER_OFFLINE])
def test_jetstreams_not_now_answers_are_waited_out(code: int) -> None:
    answer = BadRequestError(code=400, err_code=code, description="no suitable peers for placement, peer offline")
    mapped = _mapped(answer)
    assert isinstance(mapped, ServerUnavailableError) and not_now(mapped), mapped
    assert str(mapped).startswith("Opening bucket 'b': JetStream answered 'no suitable peers for placement, peer offline'")
    assert f"err_code {code}" in str(mapped)


def test_refusals_and_lasting_failures_are_not_waited_out() -> None:
    missing = _mapped(NotFoundError(code=404, err_code=ErrorCode.STREAM_NOT_FOUND, description="stream not found"))
    assert isinstance(missing, APIError) and not not_now(missing)  # JetStream's refusals pass through, for the caller
    try:
        raise server_unavailable("Reading x", 1.0, ConnectionClosedError()) from ConnectionClosedError()
    except ServerUnavailableError as closed:
        assert not not_now(closed)
    assert not not_now(AuthenticationError("bad password")) and not not_now(StorageError("disk full"))
    assert not not_now(ValueError("not a server error"))
    assert not_now(server_unavailable("Reading x", 1.0, asyncio.TimeoutError()))


async def test_each_attempt_has_a_client_side_deadline() -> None:
    attempts = 0

    async def never_answers() -> None:
        nonlocal attempts
        attempts += 1
        await asyncio.Event().wait()  # a request whose own deadline was lost

    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="Opening x: the NATS server did not answer"):
        await ride_out_jetstream(never_answers, what="Opening x", logger=logging.getLogger("test"), timeout_s=0.2,
                                 limit_s=0.5)
    # Each attempt is ended 1.2 s in (one request's 0.2 s and a second); the second one ends past the limit.
    assert attempts == 2 and 2.4 <= time.monotonic() - started < 4.0


async def test_a_closed_store_is_not_waited_for(settings: EventStoreSettings) -> None:
    store = await EventStore.connect(settings)
    await store.close()
    started = time.monotonic()
    with pytest.raises(EventStoreClosedError, match="closed"):
        async with asyncio.timeout(10):
            await store.ensure_stream(long_running=True)
    assert time.monotonic() - started < 1.0

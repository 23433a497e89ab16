"""What "nobody answered" (503) means to the store: a stream between leaders is waited for, a missing one is a
configuration error. On one server, where a missing stream is the only way to get a 503 at will."""

from __future__ import annotations

import asyncio
import time

import pytest

from eventstore import EventStore, ServerUnavailableError, StreamConfigError, StreamId

from ..conftest import unique_settings
from .events import Deposited


async def test_an_append_nobody_answers_waits_for_the_stream_within_request_timeout_s(nats_url: str) -> None:
    settings = unique_settings(nats_url, request_timeout_s=3.0)
    async with EventStore.connect(settings, create_stream=False) as store:
        store.registry.register(Deposited)
        appending = asyncio.create_task(store.append(StreamId("Account", "1"), [Deposited(amount=1)], 0))
        await asyncio.sleep(0.5)  # the append meets no stream, as it would meet no leader during an election
        assert not appending.done()
        await store.ensure_stream()
        result = await appending
        assert (result.last_version, result.duplicate) == (1, False)
        assert [e.version for e in await store.read(StreamId("Account", "1"))] == [1]


async def test_an_append_to_a_missing_stream_is_a_configuration_error_after_request_timeout_s(nats_url: str) -> None:
    settings = unique_settings(nats_url, request_timeout_s=0.5)
    async with EventStore.connect(settings, create_stream=False) as store:
        store.registry.register(Deposited)
        started = time.monotonic()
        with pytest.raises(StreamConfigError, match="does not exist.*ensure_stream"):
            await store.append(StreamId("Account", "1"), [Deposited(amount=1)], 0)
        assert time.monotonic() - started < 3


async def test_a_stream_that_does_not_cover_the_subjects_is_a_configuration_error(nats_url: str) -> None:
    settings = unique_settings(nats_url, request_timeout_s=0.5)
    async with EventStore.connect(settings) as store:
        pass
    other = settings.model_copy(update={"subject_prefix": settings.subject_prefix + "x"})
    async with EventStore.connect(other, create_stream=False) as store:
        store.registry.register(Deposited)
        with pytest.raises(StreamConfigError, match="does not store subjects"):
            await store.append(StreamId("Account", "1"), [Deposited(amount=1)], 0)


async def test_a_read_nobody_answers_waits_like_an_append_then_names_the_entity(nats_url: str) -> None:
    # A 503 for a direct get: no stream serves it. Reads wait request_timeout_s like appends, then say why.
    settings = unique_settings(nats_url, request_timeout_s=0.5)
    async with EventStore.connect(settings, create_stream=False) as store:
        with pytest.raises(StreamConfigError, match="Account/7.*does not exist"):
            await store.read(StreamId("Account", "7"))

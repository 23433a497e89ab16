"""The request/reply inbox against a responder that answers more than once (as servers between JetStream
leaders may): the first answer is the answer, later ones are dropped."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from eventstore.jetstream.inbox import Inbox


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


async def answer_twice(nc: NATS, subject: str) -> None:
    async def respond(msg: Msg) -> None:
        # Both before the requester's task runs again: the race that grew the reply list in CI.
        await nc.publish(msg.reply, json.dumps({"n": 1}).encode())
        await nc.publish(msg.reply, json.dumps({"n": 2}).encode())

    await nc.subscribe(subject, cb=respond)
    await nc.flush()


async def test_a_second_answer_to_an_api_request_is_dropped(nc: NATS) -> None:
    await answer_twice(nc, "test.inbox.twice")
    inbox = Inbox(nc)
    try:
        for _ in range(20):
            assert await inbox.api("test.inbox.twice", b"{}", 2.0, what="Asking twice") == {"n": 1}
            replies = await inbox.request("test.inbox.twice", b"{}", 2.0, what="Asking twice")
            assert [json.loads(r.data) for r in replies] == [{"n": 1}]
    finally:
        await inbox.close()


async def test_a_message_after_the_closing_status_does_not_join_a_batch(nc: NATS) -> None:
    async def respond(msg: Msg) -> None:
        await nc.publish(msg.reply, b"one")
        await nc.publish(msg.reply, b"", headers={"Status": "204", "Description": "EOB"})
        await nc.publish(msg.reply, b"late")

    await nc.subscribe("test.inbox.batch", cb=respond)
    await nc.flush()
    inbox = Inbox(nc)
    try:
        for _ in range(20):
            replies = await inbox.request("test.inbox.batch", b"", 2.0, what="Reading a batch", many=True)
            assert [r.data for r in replies] == [b"one", b""]
    finally:
        await inbox.close()

"""Reading the stream in order: an ephemeral pull consumer driven at the wire level.

nats-py's ``fetch()`` creates a future and a timeout per message and tops out
at a fraction of what the server sends. :class:`OrderedPull` instead keeps two
pull requests of up to ``batch`` messages in flight on one plain subscription
callback and hands the messages over in whole batches. It checks the
consumer's delivery sequence on every message; after a gap, a missed
heartbeat, a server restart or a lost connection it deletes the consumer and
creates a new one starting right after the last message it handed over, so the
caller sees every message of the range exactly once and in order. A live read
does the same when it has been quiet a while although the stream's leader has a
message for it (on a replicated stream, a consumer whose replica stopped
delivering after a leader change).

The server applies an atomic batch (``append_many``) one message at a time,
and a consumer can deliver the part applied so far. So a live read never ends
a yielded list inside a batch: the messages at its end that belong to a batch
whose commit (its last message, ``Nats-Batch-Commit``) has not arrived are held
back until it does, or a later message does (batches are stored contiguously:
anything after one means it is whole), or, when the commit is on a subject the
filters leave out, until ``heartbeat_s`` passes without a message (applying a
batch takes the server milliseconds).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .errors import ServerUnavailableError, map_nats_error, server_unavailable
from .wire import Header

__all__ = [
    "OrderedPull", "StoredMsg", "create_replay_consumer", "delete_consumer", "delete_consumer_later", "leader_has_message",
]

StoredMsg = tuple[int, Msg]
"""A stream message with its stream sequence."""

_NS = 1_000_000_000
_background: set[asyncio.Future[None]] = set()


async def delete_consumer(nc: NATS, stream: str, name: str, *, api_prefix: str = "$JS.API") -> None:
    """Ask the server to delete consumer ``name``, without waiting for or needing an answer.

    Never raises: the connection may be gone, and an ephemeral consumer expires by itself.
    """
    try:
        await nc.publish(f"{api_prefix}.CONSUMER.DELETE.{stream}.{name}", b"")
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def delete_consumer_later(nc: NATS, stream: str, name: str, *, api_prefix: str = "$JS.API") -> None:
    """:func:`delete_consumer` in the background (the task is kept referenced until it is done)."""
    task = asyncio.ensure_future(delete_consumer(nc, stream, name, api_prefix=api_prefix))
    _background.add(task)
    task.add_done_callback(_background.discard)


async def create_replay_consumer(
    nc: NATS,
    stream: str,
    start_seq: int,
    filter_subjects: Sequence[str],
    *,
    api_timeout_s: float,
    give_up_s: float | None,
    should_stop: Callable[[], bool] = lambda: False,
    api_prefix: str = "$JS.API",
    what: str | None = None,
) -> tuple[str, dict[str, object]]:
    """Create an ephemeral, ack-less, in-memory consumer that delivers from ``start_seq``; (name, info).

    Retries with backoff while the server is down or restarting, for up to
    ``give_up_s`` (None: forever, until ``should_stop()``; no single request
    waits past it), then raises :class:`ServerUnavailableError` naming the
    operation ``what`` (default: reading the stream). Unused, the consumer
    expires after a minute.
    """
    what = what or f"Reading stream {stream!r}"
    config: dict[str, object] = {
        "deliver_policy": "by_start_sequence",
        "opt_start_seq": start_seq,
        "ack_policy": "none",
        "replay_policy": "instant",
        "mem_storage": True,
        "num_replicas": 1,
        "inactive_threshold": 60 * _NS,
    }
    if len(filter_subjects) == 1:
        config["filter_subject"] = filter_subjects[0]
    elif filter_subjects:
        config["filter_subjects"] = list(filter_subjects)
    deadline = None if give_up_s is None else time.monotonic() + give_up_s
    delay = 0.05
    while True:
        # A new name per try: on a cluster the meta leader may have placed an unanswered try's consumer on a
        # replica that is down, and a retry under that name would wait for that replica. Short: the name is in
        # the reply subject of every message the consumer delivers.
        name = secrets.token_urlsafe(9)
        body = json.dumps({"stream_name": stream, "config": {**config, "name": name}}).encode()
        # At least two tries fit in api_timeout_s (the one after an unanswered one goes elsewhere, see above).
        try_s = max(1.0, api_timeout_s / 2)
        timeout_s = try_s if deadline is None else min(try_s, max(0.05, deadline - time.monotonic()))
        try:
            reply = await nc.request(f"{api_prefix}.CONSUMER.CREATE.{stream}.{name}", body, timeout=timeout_s)
            info: dict[str, object] = json.loads(reply.data)
            if "error" in info:
                raise ServerUnavailableError(
                    f"{what}: JetStream refused the consumer: {info['error']}. Check that the stream exists."
                )
            return name, info
        except Exception as exc:  # noqa: BLE001 - server down or restarting: retry until give_up_s
            delete_consumer_later(nc, stream, name, api_prefix=api_prefix)  # if the unanswered try created it
            if should_stop():
                raise
            if deadline is not None and time.monotonic() + delay > deadline:
                if isinstance(exc, ServerUnavailableError):
                    raise
                raise server_unavailable(what, api_timeout_s, exc) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


def _split_unfinished_batch(msgs: list[StoredMsg]) -> tuple[list[StoredMsg], list[StoredMsg]]:
    """``msgs`` up to the end of the last whole atomic batch, and the messages after it of a batch whose commit
    is not among them (none when the last message is not in a batch, or is its commit)."""
    headers = msgs[-1][1].headers or {}
    batch_id = headers.get(Header.BATCH_ID)
    if batch_id is None or Header.BATCH_COMMIT in headers:
        return msgs, []
    cut = len(msgs) - 1
    while cut > 0 and (msgs[cut - 1][1].headers or {}).get(Header.BATCH_ID) == batch_id:
        cut -= 1
    return msgs[:cut], msgs[cut:]


async def leader_has_message(
    nc: NATS,
    stream: str,
    from_seq: int,
    filter_subjects: Sequence[str],
    *,
    timeout_s: float,
    api_prefix: str = "$JS.API",
    must_answer: str | None = None,
) -> int | None:
    """The sequence of the first message at or after ``from_seq`` on one of ``filter_subjects`` (all subjects when
    empty), as the stream's leader knows it; None when there is none, or nobody answered within ``timeout_s``.

    A message get (not a direct get) is answered by the leader: on a replicated
    stream a follower's copy, and a consumer placed on it, may lag. With
    ``must_answer`` (the operation, e.g. "Reading stream 'events'"), no answer
    raises :class:`ServerUnavailableError` naming it instead of counting as none.
    """
    found: list[int] = []
    for subject in filter_subjects or [">"]:
        body = json.dumps({"seq": from_seq, "next_by_subj": subject}).encode()
        try:
            with map_nats_error(must_answer or "Asking the stream leader", timeout_s):
                reply = await nc.request(f"{api_prefix}.STREAM.MSG.GET.{stream}", body, timeout=timeout_s)
            answer = json.loads(reply.data)
        except (ServerUnavailableError, ValueError):
            if must_answer:
                raise
            continue  # no leader just now, or a lost connection: unknown, not an error
        error = answer.get("error")
        if must_answer and error is not None and error.get("code") != 404:
            raise ServerUnavailableError(f"{must_answer}: JetStream answered {error.get('description')!r}.")
        seq = (answer.get("message") or {}).get("seq")
        if isinstance(seq, int):
            found.append(seq)
    return min(found, default=None)


class OrderedPull:
    """Yields the messages of ``stream`` from ``start_seq`` on, in sequence order, in batches.

    ``filter_subjects`` limits the read to matching subjects (the positions then
    have gaps). ``stop_seq`` ends the read after that sequence, or, with
    ``live=False``, the read ends once no matching message is pending. With
    ``live=True`` it follows new messages forever, surviving server restarts
    (``give_up_s`` bounds how long a broken server is retried; by default
    ``api_timeout_s`` for a read that ends, forever for a live one). Errors are
    :class:`ServerUnavailableError` naming the operation ``what``.
    """

    def __init__(
        self,
        nc: NATS,
        stream: str,
        *,
        start_seq: int = 1,
        filter_subjects: Sequence[str] | None = None,
        stop_seq: int | None = None,
        live: bool = False,
        batch: int = 1000,
        heartbeat_s: float = 1.0,
        api_timeout_s: float = 5.0,
        give_up_s: float | None = None,
        api_prefix: str = "$JS.API",
        what: str | None = None,
    ) -> None:
        self._nc = nc
        self._what = what or f"Reading stream {stream!r}"
        self._stream = stream
        self.next_seq = max(1, start_seq)
        self._filters = list(filter_subjects or [])
        self._stop_seq = stop_seq
        self._live = live
        self._batch = batch
        self._heartbeat_s = heartbeat_s
        self._api_timeout_s = api_timeout_s
        self._give_up_s = give_up_s if give_up_s is not None else (None if live else api_timeout_s)
        self._stall_s = max(heartbeat_s * 5, 2.0)
        self._api = api_prefix
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._consumer = ""
        self._last_dseq = 0
        self._pending: int | None = None
        self._requests: deque[int] = deque()
        self._buffer: list[StoredMsg] = []
        self._wake = asyncio.Event()
        self._reset = False
        self._last_activity = 0.0
        self._last_data = 0.0  # when the consumer last delivered (or was created, or the leader was asked)
        self._closed = False
        self._held: list[StoredMsg] = []  # the end of an atomic batch not yet seen whole (live reads)

    async def _on_msg(self, msg: Msg) -> None:
        self._last_activity = time.monotonic()
        reply = msg.reply
        if not reply:
            self._on_status(msg)
            return
        tokens = reply.split(".")
        # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>, or the v2
        # form with <domain>.<account hash> after ACK and a random token at the end.
        base = 2 if len(tokens) == 9 else 4
        if tokens[base + 1] != self._consumer or self._reset:
            return
        sseq, dseq, pending = int(tokens[base + 3]), int(tokens[base + 4]), int(tokens[base + 6])
        if dseq != self._last_dseq + 1:
            self._reset = True
            self._wake.set()
            return
        self._last_dseq = dseq
        self._last_data = self._last_activity
        self._pending = pending
        self.next_seq = sseq + 1
        self._buffer.append((sseq, msg))
        if self._requests:
            self._requests[0] -= 1
            if self._requests[0] <= 0:
                self._requests.popleft()
        if len(self._buffer) >= self._batch // 2 or pending == 0 or not self._requests:
            self._wake.set()

    def _on_status(self, msg: Msg) -> None:
        headers = msg.headers or {}
        status = headers.get("Status", "")
        if status == "100":
            return  # idle heartbeat: the consumer is alive
        if status in ("404", "408", "409"):
            if self._requests:
                self._requests.popleft()
            description = headers.get("Description", "")
            if status == "409" and ("Deleted" in description or "Leadership" in description):
                self._reset = True
        self._wake.set()

    def _delete_consumer(self) -> None:
        if self._consumer and not self._nc.is_closed:
            name, self._consumer = self._consumer, ""
            delete_consumer_later(self._nc, self._stream, name, api_prefix=self._api)

    async def _create_consumer(self) -> None:
        self._delete_consumer()
        name, info = await create_replay_consumer(
            self._nc, self._stream, self.next_seq, self._filters, api_timeout_s=self._api_timeout_s,
            give_up_s=self._give_up_s, should_stop=lambda: self._closed, api_prefix=self._api, what=self._what,
        )
        self._consumer = name
        self._last_dseq = 0
        num_pending = info.get("num_pending")
        self._pending = int(num_pending) if isinstance(num_pending, int) else None
        self._requests.clear()
        self._reset = False
        self._last_activity = self._last_data = time.monotonic()

    async def _request_more(self) -> None:
        expires_s = max(self._heartbeat_s * 5, 2.0)
        body = {"batch": self._batch, "expires": int(expires_s * _NS), "idle_heartbeat": int(self._heartbeat_s * _NS)}
        self._requests.append(self._batch)
        await self._nc.publish(
            f"{self._api}.CONSUMER.MSG.NEXT.{self._stream}.{self._consumer}", json.dumps(body).encode(), reply=self._inbox
        )

    def _finished(self) -> bool:
        if self._stop_seq is not None and self.next_seq > self._stop_seq:
            return True
        return not self._live and self._pending == 0

    async def _nothing_left(self) -> bool:
        """Whether no matching message lies between ``next_seq`` and ``stop_seq``, as the stream's leader knows.

        On a replicated stream nats-server places a one-replica consumer on any
        current peer of the stream, whose copy may lag the leader's: "nothing
        pending" there does not end a read that must reach ``stop_seq``.
        """
        assert self._stop_seq is not None
        seq = await leader_has_message(
            self._nc, self._stream, self.next_seq, self._filters, timeout_s=self._api_timeout_s, api_prefix=self._api,
            must_answer=self._what,
        )
        return seq is None or seq > self._stop_seq

    async def batches(self) -> AsyncIterator[list[StoredMsg]]:
        """Yield lists of (sequence, message) in sequence order until the read is finished."""
        if self._sub is None:
            with map_nats_error(self._what, self._api_timeout_s):
                self._sub = await self._nc.subscribe(
                    self._inbox, cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1
                )
        try:
            await self._create_consumer()
            while True:
                if self._buffer:
                    out, self._buffer = self._held + self._buffer, []
                    if self._stop_seq is not None and out[-1][0] > self._stop_seq:
                        out = [m for m in out if m[0] <= self._stop_seq]
                        self.next_seq = self._stop_seq + 1
                    if self._live:
                        out, self._held = _split_unfinished_batch(out)
                    if out:
                        yield out
                    continue
                if self._finished():
                    if self._stop_seq is None or self.next_seq > self._stop_seq or await self._nothing_left():
                        return
                    self._pending = None  # the consumer's replica lags the leader: wait for it to catch up
                if self._reset or time.monotonic() - self._last_activity > self._heartbeat_s * 3:
                    await self._create_consumer()
                try:
                    while len(self._requests) < 2:
                        await self._request_more()
                except Exception:  # noqa: BLE001 - disconnected: the staleness check resets the consumer
                    self._requests.clear()
                self._wake.clear()
                if not self._buffer and not self._reset:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
                    try:
                        async with asyncio.timeout(self._heartbeat_s):
                            await self._wake.wait()
                    except TimeoutError:
                        if self._held:  # quiet for heartbeat_s: the batch is whole, its commit filtered out
                            out, self._held = self._held, []
                            yield out
                        elif self._live and time.monotonic() - self._last_data > self._stall_s:
                            self._reset = await self._stalled()
        finally:
            await self.close()

    async def _stalled(self) -> bool:
        """Whether the stream's leader has a message for this read that the consumer has not delivered.

        A live read on a replicated stream can go quiet while its consumer still
        sends heartbeats: after a leader change the consumer (placed on one
        replica) may stop delivering. Asked after ``_stall_s`` of quiet, at most
        once per ``_stall_s`` (an idle subscriber costs one message get then).
        """
        self._last_data = time.monotonic()
        seq = await leader_has_message(
            self._nc, self._stream, self.next_seq, self._filters, timeout_s=self._api_timeout_s, api_prefix=self._api
        )
        return seq is not None and seq >= self.next_seq  # not delivered while the leader was asked

    async def close(self) -> None:
        """Delete the consumer and the subscription."""
        self._closed = True
        self._delete_consumer()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                pass

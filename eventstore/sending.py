"""Sending a commit (one message, or an atomic batch of messages) until the server answers, and reading its answer.

A resend is safe: the commit's msg id, or its own check, stores it once. Resends after a lost acknowledgement
back off exponentially with jitter, at most ``append_retries`` of them; answers that mean "not now" (no leader,
a write in flight) are resent within ``request_timeout_s``. Then a typed error says whether anything may have
been stored. When no send was answered, at most half a ``request_timeout_s`` more asks the server whether it
answers at all, to tell a lost server (:class:`ServerUnavailableError`) from one whose disk failed
(:class:`StorageError`). What the answer means for the append (a conflict, a duplicate) is :mod:`.append`'s
and :mod:`.dcb_jetstream`'s business: :class:`Conflict` tells them.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError
from nats.errors import Error as NatsError

from .errors import (
    EventStoreClosedError,
    EventStoreError,
    EventTooLargeError,
    ServerUnavailableError,
    StorageError,
    StreamConfigError,
    server_unavailable,
    store_closed,
    what_was_stored,
)
from .jetstream.api import ErrorCode
from .jetstream.direct import DirectGets, LeaderWait, no_responders
from .jetstream.inbox import Inbox
from .settings import EventStoreSettings
from .wire import Header

__all__ = ["Conflict", "Sender"]

# Answers of a replicated stream's leader that mean "not now": the pre-check of its proposal cannot decide this send
# while another write it concerns is proposed but not yet applied (an earlier send of this very append, or another
# writer's append to the entity); nothing of this send is stored, and a resend once that write lands is answered
# for real (a duplicate ack, or a decided conflict). nats-server's jetstream_batching.go:
# JSStreamDuplicateMessageConflict (the msg id in process), JSStreamWrongLastSequenceConstantErr (the subject in
# process; nats-py's key-value code takes it for a conflict, which it is not yet), and
# JSStreamExpectedLastSeqPerSubjectNotReady.
_NOT_NOW: Final = {ErrorCode.MSG_ID_IN_PROCESS: "its msg id is in process",
                   ErrorCode.SUBJECT_WRITE_IN_PROCESS: "a write to its subject is in process",
                   ErrorCode.LAST_SEQUENCE_UNKNOWN: "the subject's last sequence is not known yet"}


class Conflict(Exception):
    """The server rejected the append: its concurrency check, or (``duplicate_id``) a batch's known msg id."""

    def __init__(self, duplicate_id: bool = False) -> None:
        super().__init__()
        self.duplicate_id = duplicate_id


_STORAGE_FAILED: Final = (
    "its storage has most likely failed (the disk is full or read-only; its log says \"critical write error\"), and "
    "nats-server stores nothing more on this stream until it is restarted. Free space or make the disk writable, "
    "restart the server, then retry with the same idempotency key."
)


async def _back_off(tries: int) -> None:
    """Exponential back-off with jitter before resend number ``tries``."""
    await asyncio.sleep(0.05 * 2 ** (tries - 1) * random.uniform(0.5, 1.0))


class _Incomplete(Exception):
    """The server refused an atomic batch as incomplete: it lost staged messages (a restart, or a failed write)."""


class _NotNow(Exception):
    """The server cannot decide the send while another write it concerns is in flight (see ``_NOT_NOW``)."""


class Sender:
    """Sends commits on one event store connection and turns the server's answers into acknowledgements or typed
    errors; see the module docs."""

    def __init__(self, nc: NATS, inbox: Inbox, settings: EventStoreSettings, direct: DirectGets) -> None:
        self._nc = nc
        self._inbox = inbox
        self._settings = settings
        self._direct = direct

    async def send(
        self,
        messages: list[tuple[str, dict[str, str], bytes]],
        *,
        target: str,
        others: str,
        check_size: Callable[[list[tuple[str, dict[str, str], bytes]]], None],
        stored: Callable[[], Awaitable[bool]],
    ) -> dict[str, Any]:
        """Send (subject, headers, body) messages as one commit (one message, or an atomic batch of them) and
        return the server's acknowledgement, resending as the module docs say.

        ``target`` names what is appended to ("Account/42"), ``others`` what else the batch holds ("2 other
        entities"), both for the errors; ``check_size`` refuses messages too large before the first send;
        ``stored()`` says whether the append is stored (asked to tell a failed disk from a lost server).
        A failed concurrency check raises :class:`Conflict`, a msg id the server already stored in a batch
        ``Conflict(duplicate_id=True)``; other refusals raise typed errors.
        """
        attempts = self._settings.append_retries + 1
        wait = LeaderWait(self._settings.request_timeout_s)
        attempt = unanswered = incomplete = 0
        what = f"Appending to {target}"
        while True:
            if len(messages) > 1:
                batch_id = uuid.uuid4().hex  # a batch id per send: the server refuses reused ones; msg ids dedupe
                for i, (_, headers, _) in enumerate(messages, start=1):
                    headers[Header.BATCH_ID] = batch_id
                    headers[Header.BATCH_SEQUENCE] = str(i)
                messages[-1][1][Header.BATCH_COMMIT] = "1"
            if attempt == 0:
                check_size(messages)  # resends differ only in the batch id, of the same length
            try:
                for subject, headers, body in messages[:-1]:
                    await self._nc.publish(subject, body, headers=headers)
                subject, headers, body = messages[-1]
                (reply,) = await self._inbox.request(
                    subject, body, self._settings.request_timeout_s, headers=headers, what=what,
                )
            except (ConnectionClosedError, EventStoreClosedError) as exc:
                # Closed (by the store, or for good after an outage): waiting cannot help, nothing more may be sent.
                if self._inbox.closed:
                    raise EventStoreClosedError(f"{store_closed(what)} {what_was_stored(unanswered > 0)}") from exc
                raise ServerUnavailableError(
                    f"{server_unavailable(what, self._settings.request_timeout_s, exc)} {what_was_stored(unanswered > 0)}"
                ) from exc
            except (NatsError, ServerUnavailableError) as exc:
                unanswered += 1
                if unanswered < attempts:
                    await _back_off(unanswered)
                    attempt += 1
                    continue  # resend: the msg ids make a resend safe
                raise await self._unacknowledged_error(target, stored, attempts) from exc
            if no_responders(reply):
                # Nobody received it: no leader for the stream just now (an election), or no stream at all.
                await self._direct.await_leader(wait, what, resent=unanswered > 0)
                attempt += 1
                continue
            try:
                return self._parse_ack(reply, target, others, resent=unanswered > 0)
            except _Incomplete:
                incomplete += 1
                if incomplete < attempts:  # a restart lost the staged batch: a resend heals it; a failed disk does not
                    await _back_off(incomplete)
                    attempt += 1
                    continue
                raise await self._incomplete_error(target, others, stored, attempts, resent=unanswered > 0) from None
            except _NotNow as exc:
                if await wait.again():
                    attempt += 1
                    continue
                raise ServerUnavailableError(
                    f"{what}: the server could not decide the append for "
                    f"{self._settings.request_timeout_s}s: {exc} (a write in flight that its stream's replicas have "
                    "not confirmed: an earlier send of this append, or another writer's). "
                    + ("An earlier send of this append may yet be stored: retry with the same idempotency key to find "
                       "out safely." if unanswered else "Nothing was stored by this call. Retry.")
                ) from None

    async def _unacknowledged_error(
        self, entity: str, stored: Callable[[], Awaitable[bool]], attempts: int
    ) -> ServerUnavailableError:
        """The error of an append no send of which was answered.

        A :class:`StorageError` when the server answers other requests promptly (within half of
        ``request_timeout_s``), the stream has one replica and the append is not stored: nats-server drops, without
        an answer, every write to a stream whose storage failed a write (disk full, read-only), until it restarts.
        (A replicated stream's leader steps down on a write error instead.) Else a :class:`ServerUnavailableError`.
        """
        if not await self._storage_failed(stored):
            return ServerUnavailableError(
                f"The server did not acknowledge the append to {entity} after {attempts} tries. It may or may not be "
                "stored; retry with the same idempotency key to find out safely."
            )
        return StorageError(
            f"The server answers, but did not store the append to {entity} in {attempts} tries: {_STORAGE_FAILED} "
            "The append is not stored so far (a send still queued on an overloaded server could yet be); every "
            "acknowledged event stays stored."
        )

    async def _incomplete_error(
        self, target: str, others: str, stored_now: Callable[[], Awaitable[bool]], attempts: int, *, resent: bool
    ) -> ServerUnavailableError:
        """The error of an atomic append every send of which the server refused as incomplete.

        A :class:`StorageError` when the stream's storage has most likely failed (as for
        :meth:`_unacknowledged_error`): nats-server stages a batch on the stream's disk and refuses its commit when
        it could not. Else a :class:`ServerUnavailableError`: the server lost the staged batch (restarts).
        """
        batch = f"the atomic append to {target} and {others}"
        stored = what_was_stored(resent)
        if await self._storage_failed(stored_now):
            return StorageError(
                f"The server answers, but refused {batch} as incomplete in {attempts} tries: {_STORAGE_FAILED} "
                f"{stored} Every acknowledged event stays stored."
            )
        return ServerUnavailableError(
            f"The server refused {batch} as incomplete in {attempts} tries: it lost part of the batch before the "
            f"commit (it restarted, or could not stage the batch on its disk). {stored} Retry the append."
        )

    async def _storage_failed(self, stored: Callable[[], Awaitable[bool]]) -> bool:
        """Whether the server answers promptly (within half of ``request_timeout_s``), the stream has one replica
        and the append is not ``stored()``: the signs of a stream whose storage failed a write."""
        timeout_s = self._settings.request_timeout_s
        if not self._nc.is_connected:  # reconnecting: the server is lost, not its disk
            return False
        try:
            async with asyncio.timeout(timeout_s / 2):
                info = await self._nc.jetstream(timeout=timeout_s).stream_info(self._settings.stream)
                return info.config.num_replicas == 1 and not await stored()
        except (EventStoreError, NatsError, asyncio.TimeoutError):
            return False  # unknown: the server is not answering either

    def _parse_ack(self, reply: Msg, target: str, others: str, *, resent: bool) -> dict[str, Any]:
        ack: dict[str, Any] = json.loads(reply.data)
        error = ack.get("error")
        if error is None:
            return ack
        code = error.get("err_code")
        if code == ErrorCode.WRONG_LAST_SEQUENCE:
            raise Conflict
        if code in _NOT_NOW:
            raise _NotNow(_NOT_NOW[code])
        if code == ErrorCode.BATCH_DUPLICATE_MSG_ID:
            raise Conflict(duplicate_id=True)
        description = error.get("description", "")
        # Refused as sent; but after an unanswered send, that earlier send may have been stored.
        stored = (
            "This send was refused, but an earlier one went unanswered and may have been stored: retry with the same "
            "idempotency key to find out safely."
            if resent
            else "Nothing was stored."
        )
        if code == ErrorCode.INSUFFICIENT_RESOURCES:
            raise StorageError(
                f"The server refused the append to {target}: JetStream's storage limit is "
                f"reached ({description}). {stored} Every acknowledged event stays stored. Raise max_file_store in the "
                "jetstream block of the server's configuration (by default 75% of the disk's free space when the "
                "server started) or move its store_dir to a bigger disk, and restart the server."
            )
        if code == ErrorCode.STREAM_NOT_FOUND:
            raise StreamConfigError(f"Stream {self._settings.stream!r} does not exist; create it with EventStore.ensure_stream().")
        if code == ErrorCode.STREAM_FULL:
            raise StreamConfigError(
                f"Stream {self._settings.stream!r} is full ({description}): it has a max_msgs or max_bytes limit "
                f"with discard policy new. {stored} Every stored event stays; raise the limit."
            )
        if "maximum" in description or "too large" in description or code == ErrorCode.MESSAGE_TOO_LARGE:
            raise EventTooLargeError(f"The server refused the append as too large: {description}. {stored}")
        if code == ErrorCode.BATCH_INCOMPLETE:
            raise _Incomplete
        if code == ErrorCode.BATCH_TOO_MANY_INFLIGHT:
            raise ServerUnavailableError(
                f"The server refused the atomic append to {target} and {others}: too many atomic batches are in "
                f"flight on the stream. {stored} Retry after a pause."
            )
        if code == ErrorCode.ATOMIC_DISABLED or ("atomic" in description and "disabled" in description):
            raise StreamConfigError(
                f"The server refused an atomic multi-entity append: {description}. The stream needs allow_atomic "
                "(nats-server 2.12 or newer)."
            )
        raise EventStoreError(f"The server refused the append (err_code {code}): {description}. {stored}")

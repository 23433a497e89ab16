"""Direct gets of the stream's messages, and the wait for a stream without a leader that they and appends share.

Any of the stream's replicas may answer a direct get (:class:`DirectGets`). Nobody answering (a 503) means the
stream has no leader just now: an election, or too few servers for a quorum. Nothing received the request, so
it is sent again, within :class:`LeaderWait`'s deadline (:meth:`DirectGets.await_leader`). A replica that answers
may lag the leader: a read that knows what must be there asks again within the same deadline
(:func:`retry_while_lagging`).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from nats.aio.msg import Msg

from ..errors import ServerUnavailableError, StreamConfigError, what_was_stored
from ..settings import EventStoreSettings
from ..wire import Header
from .api import ErrorCode, Subjects
from .inbox import Inbox

__all__ = ["DirectGets", "LeaderWait", "no_responders", "retry_while_lagging"]

T = TypeVar("T")


class LeaderWait:
    """Retries of answers that mean "not now" within ``timeout_s`` of the first, with jittered backoff: "no
    responders" (503), or a subject with a write in flight (10164).

    A replicated stream has no leader for a few seconds after its leader is
    lost (an election) or steps down, and JetStream answers nothing for it:
    the client sees a 503. The answer means nobody received the request, so
    sending it again is safe.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.waited = 0
        self._since: float | None = None
        self._step = 0.05

    async def again(self) -> bool:
        """Wait before the next try and return True, or return False at once when ``timeout_s`` has passed."""
        now = asyncio.get_running_loop().time()
        if self._since is None:
            self._since = now
        left = self._since + self.timeout_s - now
        if left <= 0:
            return False
        self.waited += 1
        await asyncio.sleep(min(left, random.uniform(self._step / 2, self._step)))
        self._step = min(self._step * 2, 1.0)
        return True


async def retry_while_lagging(attempt: Callable[[], Awaitable[T | None]], timeout_s: float, failure: str) -> T:
    """The first answer of ``attempt()`` that is not None. None says the replica that answered lacks what the
    stream's leader has (any replica answers a direct get, and one may lag): ``attempt`` is tried again, with
    :class:`LeaderWait`'s backoff, until ``timeout_s`` has passed, then :class:`ServerUnavailableError` says
    ``failure``."""
    wait = LeaderWait(timeout_s)
    while (answer := await attempt()) is None:
        if not await wait.again():
            raise ServerUnavailableError(failure)
    return answer


def _lost_reply(msgs: list[Msg]) -> bool:
    """Whether a direct get batch's answer lacks a message: the server names in each message the sequence of
    the one it sent before (``Nats-Last-Sequence``, 0 for the first) and in the closing status the last one."""
    before = "0"
    for msg in msgs:
        headers = msg.headers or {}
        named = headers.get(Header.LAST_SEQUENCE)
        if named is None:
            return False  # a single get, a "no results" status, or a server that does not say
        if named != before:
            return True
        before = headers.get(Header.SEQUENCE, "")
    return False


def no_responders(msg: Msg) -> bool:
    """Whether ``msg`` is the server's "no responders" status: nobody received the request."""
    return not msg.data and bool(msg.headers) and (msg.headers or {}).get(Header.STATUS) == "503"


class DirectGets:
    """Direct get requests to the store's stream over its request inbox; one per event store connection."""

    def __init__(self, inbox: Inbox, settings: EventStoreSettings) -> None:
        self._inbox = inbox
        self._settings = settings
        self._subjects = Subjects(settings.stream)

    async def direct_get(self, payload: dict[str, object], *, what: str) -> list[Msg]:
        """One direct get batch request for the operation ``what``; returns the data messages (not the status).

        Retried while nobody answers (a replicated stream between leaders), and when a message of the answer
        was lost on the way (each names the one sent before it), up to ``request_timeout_s``: an answer short of
        a message is never taken for a shorter history.
        """
        wait = LeaderWait(self._settings.request_timeout_s)
        while True:
            msgs = await self._inbox.request(
                self._subjects.direct_get(),
                json.dumps(payload).encode(),
                self._settings.request_timeout_s,
                what=what,
                many=True,
            )
            if _lost_reply(msgs):
                if await wait.again():
                    continue
                raise ServerUnavailableError(
                    f"{what}: messages of the server's answers were lost on the way for {self._settings.request_timeout_s}s "
                    "(a lossy connection or an overloaded client). Nothing was read; retry, and check the network."
                )
            if not no_responders(msgs[-1]):
                break
            await self.await_leader(wait, what)
        status = (msgs[-1].headers or {}).get(Header.STATUS, "")
        if status not in ("204", "404"):
            raise ServerUnavailableError(f"{what}: the server answered with status {status}.")
        return msgs[:-1]

    async def get_each(self, positions: list[int], *, what: str) -> list[Msg | None]:
        """The message at each position (None where there is none): direct gets by sequence, O(1) each on the
        server, all sent before the first reply is awaited."""
        wait = LeaderWait(self._settings.request_timeout_s)
        while True:
            msgs = await self._inbox.request_each(
                self._subjects.direct_get(),
                [b'{"seq":%d}' % p for p in positions],
                self._settings.request_timeout_s,
                what=what,
            )
            if not any(no_responders(m) for m in msgs):
                break
            await self.await_leader(wait, what)
        found: list[Msg | None] = []
        for msg in msgs:
            status = (msg.headers or {}).get(Header.STATUS)
            if status is not None and status != "404":
                raise ServerUnavailableError(f"{what}: the server answered with status {status}.")
            found.append(None if status else msg)
        return found

    async def subject_pages(
        self, subject: str, from_seq: int = 1, page: int = 1000, *, what: str
    ) -> AsyncIterator[list[Msg]]:
        """Every message on ``subject`` from ``from_seq`` on, in pages of direct get batches, for the operation ``what``."""
        seq = from_seq
        while True:
            msgs = await self.direct_get({"seq": seq, "next_by_subj": subject, "batch": page}, what=what)
            if msgs:
                yield msgs
            if not msgs or (msgs[-1].headers or {}).get(Header.NUM_PENDING, "0") == "0":
                return
            seq = int((msgs[-1].headers or {})[Header.SEQUENCE]) + 1

    async def await_leader(self, wait: LeaderWait, what: str, *, resent: bool = False) -> None:
        """Wait before resending a request nobody answered (503), or raise why there is no point.

        A 503 means no leader for the stream just now (an election, a lost
        quorum) or no stream at all. The stream is asked about at the first 503
        only (briefly: without a meta leader nobody answers): a stream the
        server says does not exist, or that does not cover this store's
        subjects, is :class:`StreamConfigError` at once; otherwise the resends
        back off until ``request_timeout_s`` from the first 503 has passed, then
        :class:`ServerUnavailableError` naming ``what``.
        """
        if wait.waited == 0:
            problem = await self._stream_problem(what, min(1.0, self._settings.request_timeout_s / 4))
            if problem is not None:
                raise problem
        if await wait.again():
            return
        raise ServerUnavailableError(
            f"{what}: stream {self._settings.stream!r} had no leader for {self._settings.request_timeout_s}s (a leader "
            f"election, or too few of its servers are up for a quorum). {what_was_stored(resent)} Retry; check the "
            "cluster's nodes if it persists."
        )

    async def _stream_problem(self, what: str, timeout_s: float) -> StreamConfigError | None:
        """:class:`StreamConfigError` when the server says the stream does not exist or does not cover this store's
        subjects; None when it exists as needed, or no answer came within ``timeout_s``."""
        stream, prefix = self._settings.stream, self._settings.subject_prefix
        try:
            (reply,) = await self._inbox.request(self._subjects.stream_info(), b"", timeout_s, what=what)
            info = json.loads(reply.data) if reply.data else {}
        except (ServerUnavailableError, ValueError):
            return None
        code = (info.get("error") or {}).get("err_code")
        subjects = (info.get("config") or {}).get("subjects")
        if code == ErrorCode.STREAM_NOT_FOUND:
            return StreamConfigError(
                f"{what}: stream {stream!r} does not exist. Create it with EventStore.ensure_stream() "
                "(EventStore.connect does, unless told not to)."
            )
        if subjects is not None and f"{prefix}.>" not in subjects:
            return StreamConfigError(
                f"{what}: stream {stream!r} does not store subjects {prefix}.> (its subjects: {subjects}). Check "
                "subject_prefix and stream, or create the stream with EventStore.ensure_stream()."
            )
        return None

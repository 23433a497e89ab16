"""Reading one DCB index subject (``<prefix>_tags.<tag>``): by its back pointers where the server verified them.

An index message whose tag the append also checked carries ``Es-Previous``: the positions of the subject's
previous index messages, most recent first (up to :data:`INDEX_POINTERS`, ending with 0 at the
subject's start). The first of them is the check's expected sequence, which the server compared with the
subject's last message in the same commit: the pointers never skip a message. So the subject is read from its
last message (as the stream's leader knows it) back through the pointers, ``INDEX_POINTERS`` messages per
round trip of pipelined direct gets by sequence, whatever the stream's size; or, when the span to read is short or
the subject's recent messages lie close together, in one ``next_by_subj`` scan, as an entity's load decides
(:func:`~.entity_commits.scan_is_cheaper`). Below a message without pointers
(its tag was written unchecked) the rest is scanned with ``next_by_subj``, whose cost grows with the span of the
stream it crosses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, Literal, NamedTuple

from nats.aio.msg import Msg

from .commit import MAX_ENTITIES_PER_APPEND
from .entity_commits import scan_is_cheaper
from .errors import EventDecodeError
from .jetstream.direct import DirectGets, retry_while_lagging
from .wire import Header

__all__ = ["INDEX_POINTERS", "IndexMessages", "IndexReads", "Last", "index_floor", "index_messages", "pointers", "scan"]

INDEX_POINTERS: Final = 16
"""How many earlier index messages' positions an index message holds: a read fetches that many per round trip.
Twice an entity commit's (:data:`~.wire.PREVIOUS_COMMITS`): an index message is otherwise empty, and a tag is
read whole more often than an entity (about 8 bytes a pointer; bench_dcb measures both)."""


class Last(NamedTuple):
    """A subject's last message as the stream's leader knows it: its sequence, its commit's position, its
    headers (``seq`` 0 when the subject holds none)."""

    seq: int
    commit: int
    headers: Mapping[str, str]


def index_floor(after: int) -> int:
    """The position below which no index message of a commit after ``after`` lies: an index message precedes its
    commit within one atomic batch (at most :data:`~.commit.MAX_ENTITIES_PER_APPEND` messages). ``after`` itself
    when it ends a batch, as every position a read or an append returns does; this covers any other."""
    return max(0, after - MAX_ENTITIES_PER_APPEND + 1)


def pointers(headers: Mapping[str, str], seq: int) -> tuple[int, ...] | None:
    """The verified back pointers of the index message at ``seq`` (None when it has none); a malformed
    ``Es-Previous`` raises :class:`EventDecodeError`."""
    text = headers.get(Header.PREVIOUS)
    if text is None:
        return None
    try:
        found = tuple(int(p) for p in text.split(","))
    except ValueError:
        found = ()
    if not found or found[-1] < 0 or found[0] >= seq or any(a <= b for a, b in zip(found, found[1:])):
        raise _foreign(f"the index message at position {seq} has Es-Previous {text[:60]!r}, not a list of "
                       "decreasing positions below it")
    return found


def _foreign(what: str) -> EventDecodeError:
    """The error for a DCB index holding a message jetsourcing did not write: ``what`` says what was found."""
    return EventDecodeError(
        f"Malformed DCB index: {what}. It was not written by jetsourcing; keep foreign messages off the index subjects."
    )


IndexMessages = list[tuple[int, Mapping[str, str]]]
"""Index messages as (position, headers)."""

IndexReads = Literal["auto", "chain", "scan"]
"""How an index is read: as :func:`~.entity_commits.scan_is_cheaper` decides, by its back pointers, or by a scan."""


async def index_messages(
    direct: DirectGets, subject: str, last: Last, after: int, timeout_s: float,
    on_walked: Callable[[IndexMessages], None] | None = None, *, how: IndexReads = "auto",
) -> IndexMessages:
    """Every message on ``subject`` after ``after`` up to ``last`` (inclusive), newest first, as (seq, headers).

    ``on_walked`` is called with each round trip's messages found by back pointers (the first with ``last``), as
    soon as they arrive: a reader can fetch their commits while the walk goes on. ``how`` picks the method
    (see :data:`IndexReads`).
    """
    if last.seq <= after:
        return []
    previous = pointers(last.headers, last.seq)
    cheaper = how == "auto" and scan_is_cheaper(last.seq, after + 1, previous, INDEX_POINTERS)
    if previous is not None and (how == "scan" or cheaper):
        return (await scan(direct, subject, after, last.seq, timeout_s))[::-1]
    found: IndexMessages = [(last.seq, last.headers)]
    if on_walked is not None:
        on_walked(found[:])
    while previous is not None:
        wanted = [p for p in previous if p > after]
        walked: IndexMessages = [
            (int((m.headers or {})[Header.SEQUENCE]), m.headers or {}) for m in await _get_each(direct, subject, wanted, timeout_s)
        ]
        found += walked
        if on_walked is not None and walked:
            on_walked(walked)
        if len(wanted) < len(previous):  # reached ``after``, or the subject's start (a 0)
            return found
        previous = pointers(found[-1][1], found[-1][0])
    return found + (await scan(direct, subject, after, found[-1][0], timeout_s))[-2::-1]  # (it ends with found[-1])


async def _get_each(direct: DirectGets, subject: str, positions: list[int], timeout_s: float) -> list[Msg]:
    """The messages at ``positions``, all on ``subject``; retried while a replica that answers lacks one."""
    async def attempt() -> list[Msg] | None:
        msgs = await direct.get_each(positions, what="Reading a DCB index")
        found = [m for m in msgs if m is not None]
        return found if len(found) == len(msgs) else None

    got = await retry_while_lagging(attempt, timeout_s, (
        f"Reading a DCB index: positions {positions} were not found within {timeout_s}s (a replica lags the "
        "stream's leader, or messages were deleted). Nothing was returned; retry."
    ))
    for p, msg in zip(positions, got):
        if (msg.headers or {}).get(Header.SUBJECT) != subject:
            raise _foreign(f"a back pointer on {subject} leads to position {p}, which holds no message of it")
    return got


async def scan(
    direct: DirectGets, subject: str, after: int, last: int, timeout_s: float
) -> list[tuple[int, Mapping[str, str]]]:
    """The messages on ``subject`` after ``after`` up to ``last`` (a message on it), oldest first, read by
    ``next_by_subj`` from a replica that holds ``last`` (retried while the one that answers does not)."""
    if last <= after:
        return []

    async def attempt() -> IndexMessages | None:
        found: IndexMessages = []
        async for page in direct.subject_pages(subject, after + 1, what="Reading a DCB index"):
            for msg in page:
                headers = msg.headers or {}
                reached = int(headers[Header.SEQUENCE])
                if reached > last:
                    return found
                found.append((reached, headers))
                if reached == last:
                    return found
        return None

    return await retry_while_lagging(attempt, timeout_s, (
        f"Reading a DCB index: the replicas answering did not reach position {last} within {timeout_s}s "
        "(they lag the stream's leader). Nothing was returned; retry."
    ))

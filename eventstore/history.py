"""An entity's history is whole: the checks every load, and every append's lookup, runs on the commits it read.

Each commit says where it belongs in its entity's history three ways: ``Es-Version`` (its last event's
version; its first is that minus its event count plus one), ``Es-Previous`` (the positions of the entity's
previous commits, 0 at its start) and ``Nats-Expected-Last-Subject-Sequence`` (the position of the entity's
last commit when it was stored, which the server checked then). A whole history has versions 1, 2, 3, ...
without a hole or a repeat, and each commit's pointers name the commit read before it.

A commit can be lost from a load in several ways: deleted or purged before the stream denied it, lost in a
restore, or left out of an answer (a replica that lags, a reply lost on the way). A commit can also lie: one
published by another program with a version or a pointer of its own choosing. :func:`check_history` turns
each into :class:`HistoryGapError` naming the entity, the position and the version due there;
:func:`commit_place` checks the one commit an append builds on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .errors import EventDecodeError, HistoryGapError
from .streams import StreamId
from .wire import Header, commit_previous

__all__ = ["check_history", "commit_place"]

# The headers without which a message is not a commit of ours (see wire.py's table).
_REQUIRED = (Header.TYPE, Header.SCHEMA_VERSION, Header.EVENT_ID, Header.VERSION, Header.RECORDED_AT)
_TYPE, _VERSION, _SCHEMA_VERSION, _EVENT_ID = Header.TYPE, Header.VERSION, Header.SCHEMA_VERSION, Header.EVENT_ID
_RECORDED_AT, _PREVIOUS, _EXPECTED = Header.RECORDED_AT, Header.PREVIOUS, Header.EXPECTED_LAST_SUBJECT_SEQUENCE


def commit_place(stream_id: StreamId, position: int, headers: Mapping[str, str] | None) -> tuple[int, int, int | None]:
    """The first and last versions of the stored commit at ``position`` with these headers, and the position of
    the entity's commit before it (0 at the entity's start; None when the commit does not say).

    Raises :class:`EventDecodeError` for a message jetsourcing did not write (a required header missing or not
    a number), and :class:`HistoryGapError` for a commit that contradicts itself: a first version of 1 after
    another commit (a forged restart), a later version that claims to be the entity's first commit, or a back
    pointer that is not the position the server checked when it stored the commit.
    """
    # Every load runs this once per commit: the common case costs a few dict lookups and two int() calls.
    headers = headers or {}
    if not (_TYPE in headers and _VERSION in headers and _RECORDED_AT in headers and _SCHEMA_VERSION in headers
            and _EVENT_ID in headers):
        missing = ", ".join(name for name in _REQUIRED if name not in headers)
        raise EventDecodeError(
            f"Message at position {position} on {stream_id} has no {missing} header: it was not written "
            "by jetsourcing, so nothing can be built on it. Keep foreign messages off the event subjects."
        )
    try:
        last = int(headers[_VERSION])
    except ValueError:
        raise EventDecodeError(
            f"Message at position {position} on {stream_id} has no valid {Header.VERSION} header "
            f"({headers[_VERSION][:40]!r}): it was not written by jetsourcing. Keep foreign messages off the "
            "event subjects."
        ) from None
    first = last - headers[_TYPE].count(",")
    # Only the most recent pointer matters here (the walk checks the others as it follows them).
    pointers = headers.get(_PREVIOUS)
    head = None if pointers is None else pointers.partition(",")[0]
    if head is not None and not (head.isascii() and head.isdigit()):
        commit_previous(headers, stream_id)  # raises: a malformed pointer
    checked = headers.get(_EXPECTED)
    # The server checked the expected sequence when it stored the commit: the best witness of what preceded it.
    before = int(checked) if checked is not None and checked.isdigit() else None
    previous = int(head) if head is not None else before
    if before is None:
        before = previous
    if before is not None and (first == 1) != (before == 0):
        problem = (
            f"the commit there claims version 1 (a new entity) although it was stored after the entity's commit at "
            f"position {before} (a forged restart)"
            if first == 1
            else f"the commit there holds versions {first} to {last} but claims to be the entity's first commit"
        )
        raise HistoryGapError(stream_id, position, first, problem)
    if previous != before:
        raise HistoryGapError(
            stream_id, position, first,
            f"the commit there points back to position {previous}, but the server stored it after the entity's "
            f"commit at position {before} (a forged or altered commit)",
        )
    return first, last, previous


def check_history(
    stream_id: StreamId, commits: Sequence[tuple[int, Mapping[str, str] | None]], *, due: int | None
) -> None:
    """Raise unless ``commits`` (position, headers), oldest first, are one piece of the entity's history.

    ``due`` is the version the first commit must start with (1 for a read from the entity's start), or None
    when unknown (a read from a later position: then it is checked against the pointers it carries). Each
    commit is checked by :func:`commit_place`, must start with the version after the one before it, and must
    point back to the commit before it. Raises :class:`HistoryGapError` naming the position where the history
    breaks and the version due there.
    """
    before: int | None = None
    for position, headers in commits:
        first, last, previous = commit_place(stream_id, position, headers)
        if due is not None and first != due:
            if first > due:
                missing = f"version {due}" if first == due + 1 else f"versions {due} to {first - 1}"
                problem = (f"the commit there holds versions {first} to {last}, but version {due} was due: "
                           f"{missing} {'is' if first == due + 1 else 'are'} missing")
            else:
                problem = (f"the commit there holds versions {first} to {last}, but version {due} was due: it "
                           "repeats versions already read (a forged or restored commit)")
            raise HistoryGapError(stream_id, position, due, problem)
        if before is not None and previous is not None and previous != before:
            raise HistoryGapError(
                stream_id, position, first,
                f"the commit there points back to position {previous}, but the entity's commit before it was read "
                f"at position {before}",
            )
        due, before = last + 1, position

"""Where a read of the stream may end: positions that never cut an atomic batch in two.

The server applies an atomic batch (``append_many``) one message at a time, and
stream info can show a prefix of it; a reader that ends a range there shows
part of a command's events. These functions ask the stream's leader with
message gets, which are isolated from batch commits, so what they return is
always the end of a whole commit. A planner of ranges (the Spark streaming
source) cuts its micro-batches with them.
"""

from __future__ import annotations

import base64
import json
import re

from ..errors import ServerUnavailableError, StreamConfigError
from ..wire import Header
from .api import API_PREFIX, TRANSIENT_API_ERRORS, ErrorCode, Subjects
from .replay import _api
from .transport import BulkConnection

__all__ = ["last_commit_boundary", "whole_commits_end"]

_BATCH_SEQUENCE = re.compile(rb"\r\n" + re.escape(Header.BATCH_SEQUENCE.encode()) + rb":[ \t]*([0-9]+)")
_BATCH_COMMIT = b"\r\n" + Header.BATCH_COMMIT.encode() + b":"


async def last_commit_boundary(
    conn: BulkConnection, stream: str, *, timeout_s: float, api_prefix: str = API_PREFIX
) -> int:
    """The stream's last position as its leader knows it (0 when empty), never inside an atomic batch.

    Raises :class:`~eventstore.StreamConfigError` when the stream does not exist and
    :class:`~eventstore.ServerUnavailableError` when no leader answers within ``timeout_s``.
    """
    what = f"Reading the last position of stream {stream!r}"
    found = await _message(conn, stream, {"last_by_subj": ">"}, timeout_s, what, api_prefix)
    if found is not None:
        return found[0]
    # No last message: the stream is empty, or its last message was deleted.
    info = await _api(conn, Subjects(stream, api_prefix).stream_info(), b"", timeout_s, what)
    _raise_for_missing_stream(info, stream)
    state = info.get("state")
    return int(state.get("last_seq") or 0) if isinstance(state, dict) else 0


async def whole_commits_end(
    conn: BulkConnection, stream: str, after: int, at_most: int, *, timeout_s: float, api_prefix: str = API_PREFIX
) -> int:
    """The end of the longest run of whole commits after position ``after`` that stops at or before ``at_most``.

    ``after`` must be a commit boundary and ``at_most`` at most the stream's last
    boundary (:func:`last_commit_boundary`). When ``at_most`` falls inside an atomic
    batch that begins right after ``after``, a run ending at or before ``at_most``
    would be empty, so the batch's own end (past ``at_most``) is returned instead:
    the result is always greater than ``after``.
    """
    if at_most <= after:
        raise ValueError(f"at_most ({at_most}) must be greater than after ({after})")
    what = f"Finding where the commits after position {after} of stream {stream!r} end"
    found = await _message(conn, stream, {"seq": at_most}, timeout_s, what, api_prefix)
    place = None if found is None else _place_in_open_batch(found[1])
    if place is None:
        return at_most  # a single commit, the last message of a batch, or a deleted message
    before_batch = at_most - place
    if before_batch > after:
        return before_batch
    # The batch is the first commit after `after` and longer than the bound: it ends later, at its commit.
    seq = at_most
    while True:
        found = await _message(conn, stream, {"seq": seq + 1, "next_by_subj": ">"}, timeout_s, what, api_prefix)
        if found is None:
            return seq  # cannot happen below the last boundary; never loop on it
        seq = found[0]
        if _place_in_open_batch(found[1]) is None:
            return seq


def _place_in_open_batch(headers: bytes) -> int | None:
    """Which message (1, 2, ...) of its atomic batch a stored message is, when it is not the batch's commit."""
    found = _BATCH_SEQUENCE.search(headers)
    if found is None or _BATCH_COMMIT in headers:
        return None
    return int(found.group(1))


async def _message(
    conn: BulkConnection, stream: str, request: dict[str, object], timeout_s: float, what: str, api_prefix: str
) -> tuple[int, bytes] | None:
    """A message get answered by the stream's leader: the message's (sequence, header block), None if none."""
    body = json.dumps(request).encode()
    answer = await _api(conn, Subjects(stream, api_prefix).msg_get(), body, timeout_s, what)
    _raise_for_missing_stream(answer, stream)
    message = answer.get("message")
    if not isinstance(message, dict):
        error = answer.get("error")
        if isinstance(error, dict) and error.get("code") == 404:
            return None
        if isinstance(error, dict) and error.get("err_code") in TRANSIENT_API_ERRORS:
            raise ServerUnavailableError(f"{what}: JetStream answered {error.get('description')!r} (between leaders).")
        raise StreamConfigError(f"{what}: JetStream answered {error!r}.")
    return int(message["seq"]), base64.b64decode(message.get("hdrs") or b"")


def _raise_for_missing_stream(answer: dict[str, object], stream: str) -> None:
    error = answer.get("error")
    if isinstance(error, dict) and error.get("err_code") == ErrorCode.STREAM_NOT_FOUND:
        raise StreamConfigError(
            f"Stream {stream!r} does not exist. Check the stream name (JETSOURCING_STREAM, or the 'stream' option)."
        )

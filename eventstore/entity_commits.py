"""One entity's commits on the stream: its version and position as last read or written, and its commits.

* **Remembered state.** :class:`EntityCommits` keeps the last (version, position) of every entity this
  connection read or wrote, so an append after a load needs no lookup; on a miss :meth:`EntityCommits.state`
  looks the entity's last commit up with one direct get.
* **Back pointers.** Each commit carries ``Es-Previous``: the positions of the entity's previous commits (up
  to :data:`~.wire.PREVIOUS_COMMITS`), built from the previous commit's own pointers when they are known (this
  connection read or wrote that commit), else just the previous position (:meth:`EntityCommits.back_pointers`).
  :meth:`EntityCommits.commits` walks them, or scans a short or dense span; it serves loads (see
  :mod:`.reading`), :meth:`EntityCommits.find_append` and the keyed search of a retried append.
* **Broken entities.** An entity a load found broken (a hole, a forged commit) is read whole again before
  anything is built on it (:meth:`EntityCommits.mark_broken`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final, Literal

from nats.aio.msg import Msg

from .errors import HistoryGapError, InvalidArgumentError
from .events import AppendResult, StreamState
from .history import check_history, commit_place
from .jetstream.direct import DirectGets
from .settings import EventStoreSettings
from .streams import StreamId
from .wire import PREVIOUS_COMMITS, Header, check_idempotency_key, commit_previous, commit_version, escape_key, note_of

__all__ = ["EntityCommits", "is_commit_of"]

# A scan of the stream between from_position and the last commit costs the server about 0.1 us per message;
# a walk costs a round trip (~0.3 ms) per PREVIOUS_COMMITS commits. So a span this small is always scanned,
# and so is an entity whose last PREVIOUS_COMMITS commits lie within this many messages each (dense: a scan
# reads few other messages per commit). load_scan_vs_chain in benchmarks/bench_aggregates.py measures both.
_SCAN_SPAN: Final = 2000
_SCAN_SPAN_PER_COMMIT: Final = 256


class EntityCommits:
    """What one event store connection knows of each entity, and reading an entity's commits; see the module docs."""

    def __init__(self, direct: DirectGets, settings: EventStoreSettings, cache_size: int = 100_000) -> None:
        self._direct = direct
        self._settings = settings
        # stream -> (version, position, back pointers of the commit at position, when known)
        self._known: OrderedDict[StreamId, tuple[int, int, tuple[int, ...] | None]] = OrderedDict()
        self._cache_size = cache_size
        # Entities a load of this store found broken (a hole, a forged commit): appends and lookups read them
        # whole again first, so nothing is built on them until the stream is repaired.
        self._broken: OrderedDict[StreamId, None] = OrderedDict()

    def known(self, stream_id: StreamId) -> tuple[int, int, tuple[int, ...] | None] | None:
        """The entity's remembered (version, position, back pointers of the commit there), if any."""
        return self._known.get(stream_id)

    def forget(self, stream_id: StreamId) -> None:
        """Drop what is remembered of the entity: the next append looks it up."""
        self._known.pop(stream_id, None)

    def remember(
        self, stream_id: StreamId, version: int, position: int, previous: tuple[int, ...] | None = None
    ) -> None:
        """Note an entity's (version, position) as just read or written, so the next append skips a lookup;
        ``previous``: the back pointers of the commit at ``position``, so the next commit's extend them."""
        known = self._known.get(stream_id)
        if known is not None and known[1] > position:
            return
        if previous is None and known is not None and known[1] == position:
            previous = known[2]
        self._known[stream_id] = (version, position, previous)
        self._known.move_to_end(stream_id)
        if len(self._known) > self._cache_size:
            self._known.popitem(last=False)

    def mark_broken(self, stream_id: StreamId) -> None:
        """Note that a load found the entity's history broken: forget its state, and until a load from its start
        reads it whole, let :meth:`state` and every append read it whole first (and raise while it is not)."""
        self._known.pop(stream_id, None)
        self._broken[stream_id] = None
        self._broken.move_to_end(stream_id)
        if len(self._broken) > self._cache_size:
            self._broken.popitem(last=False)

    def mark_whole(self, stream_id: StreamId) -> None:
        """Note that a load read the entity whole from its start (undoes :meth:`mark_broken`)."""
        self._broken.pop(stream_id, None)

    async def recheck(self, stream_id: StreamId) -> None:
        """Raise :class:`HistoryGapError` while an entity a load found broken still is (see :meth:`mark_broken`)."""
        if self._broken and stream_id in self._broken:
            await self.commits(stream_id, what=f"Checking the history of {stream_id}")  # pops it when whole

    async def state(self, stream_id: StreamId) -> StreamState:
        """The entity's current version and last position, read from the server (0, 0 without events)."""
        await self.recheck(stream_id)
        subject = stream_id.subject(self._settings.subject_prefix)
        msgs = await self._direct.direct_get({"multi_last": [subject], "batch": 1}, what=f"Reading the version of {stream_id}")
        if not msgs:
            return StreamState(stream_id, 0, 0)
        headers = msgs[0].headers or {}
        position = int(headers[Header.SEQUENCE])
        # A foreign message, or a commit that contradicts itself (a forged restart), is nothing to build on.
        _, version, _ = commit_place(stream_id, position, headers)
        state = StreamState(stream_id, version, position)
        self.remember(stream_id, state.version, state.position, commit_previous(headers, stream_id))
        return state

    def back_pointers(self, stream_id: StreamId, prev_position: int) -> tuple[int, ...]:
        """The ``Es-Previous`` of a commit that follows the entity's commit at ``prev_position`` (0: none)."""
        if prev_position == 0:
            return (0,)
        known = self._known.get(stream_id)
        if known is not None and known[1] == prev_position and known[2] is not None:
            return (prev_position, *known[2][: PREVIOUS_COMMITS - 1])
        return (prev_position,)

    async def find_append(self, stream_id: StreamId, idempotency_key: str, from_position: int = 1) -> AppendResult | None:
        """The commit an earlier append with exactly ``idempotency_key`` stored on this entity at ``from_position``
        or later, if any."""
        key = check_idempotency_key(idempotency_key)
        if key is None:
            raise InvalidArgumentError("find_append needs an idempotency_key (a non-empty str), not None.")
        found, _ = await self.search(stream_id, escape_key(key), None, from_position)
        if found is None:
            return None
        headers = found.headers or {}
        count = headers[Header.TYPE].count(",") + 1
        last = int(headers[Header.VERSION])
        return AppendResult(stream_id, int(headers[Header.SEQUENCE]), last - count + 1, last, True, note_of(headers))

    async def search(
        self, stream_id: StreamId, escaped_key: str | None, commit_msg_id: str | None, from_seq: int = 1
    ) -> tuple[Msg | None, int]:
        """The entity's first commit from ``from_seq`` on of the append keyed ``escaped_key`` (or whose msg id is
        ``commit_msg_id``), and the last position searched. Reading the entity remembers its last commit, which
        spares a retry its lookup."""
        last = from_seq - 1
        for msg in await self.commits(stream_id, from_position=from_seq, what=f"Searching {stream_id} for an earlier append"):
            if is_commit_of(msg, escaped_key, commit_msg_id):
                return msg, last
            last = int((msg.headers or {})[Header.SEQUENCE])
        return None, last

    async def commits(
        self,
        stream_id: StreamId,
        *,
        from_position: int = 1,
        how: Literal["auto", "chain", "scan"] = "auto",
        what: str | None = None,
    ) -> list[Msg]:
        """The entity's commits from ``from_position`` on, in order, up to its last commit at the call (which is
        remembered for the next append), for the operation ``what`` (default "Reading <entity>").

        ``how`` picks the method (see the module docs of :mod:`.reading`): "auto" scans a short span or a dense
        entity, as the last commit's back pointers tell, and walks the pointers otherwise.
        Checked by :func:`~.history.check_history` before anything is remembered: a back pointer leading off
        the entity, versions that do not run on (from 1, when reading from the start), or pointers that skip a
        commit raise :class:`HistoryGapError` naming the position (the reader retries it through the stream's
        leader); a foreign message raises :class:`EventDecodeError`.
        """
        subject = stream_id.subject(self._settings.subject_prefix)
        what = what or f"Reading {stream_id}"
        last = await self._direct.direct_get({"multi_last": [subject], "batch": 1}, what=what)
        if not last or int((last[0].headers or {})[Header.SEQUENCE]) < from_position:
            return []
        newest = last[0]
        position = int((newest.headers or {})[Header.SEQUENCE])
        previous = commit_previous(newest.headers, stream_id)
        if how == "scan" or (how == "auto" and scan_is_cheaper(position, from_position, previous, PREVIOUS_COMMITS)):
            found = await self._scan(subject, from_position, newest, what)
        else:
            found = await self._walk(stream_id, subject, from_position, newest, what)
        # Only a whole history is remembered: the next append must never build on one with a hole.
        check_history(stream_id, [(int((m.headers or {})[Header.SEQUENCE]), m.headers) for m in found],
                      due=1 if from_position <= 1 else None)
        if from_position <= 1 and self._broken:
            self.mark_whole(stream_id)
        self.remember(stream_id, commit_version(newest.headers, stream_id), position, previous)
        return found

    async def _walk(self, stream_id: StreamId, subject: str, from_position: int, newest: Msg, what: str) -> list[Msg]:
        """The entity's commits from ``from_position`` up to ``newest`` (inclusive), by their back pointers."""
        walked = [newest]  # newest first
        previous = commit_previous(newest.headers, stream_id)
        while True:
            if previous is None:  # a commit written before back pointers: scan what lies below it
                older = await self._scan(subject, from_position, walked[-1], what)
                return older[:-1] + walked[::-1]
            wanted = [p for p in previous if p >= max(1, from_position)]
            pointing = int((walked[-1].headers or {})[Header.SEQUENCE])
            if wanted:
                got = await self._direct.get_each(wanted, what=what)
                for p, msg in zip(wanted, got):
                    if msg is None or (msg.headers or {}).get(Header.SUBJECT) != subject:
                        # Deleted, not yet on the replica that answered, or a forged pointer: the reader retries
                        # through the stream's leader, which tells them apart.
                        raise HistoryGapError(
                            stream_id, pointing, None,
                            f"the back pointer of the commit there leads to position {p}, which holds no commit of "
                            "that entity",
                        )
                    walked.append(msg)
            if len(wanted) < len(previous):  # reached from_position, or the entity's start (a 0)
                return walked[::-1]
            previous = commit_previous(walked[-1].headers, stream_id)

    async def _scan(self, subject: str, from_position: int, newest: Msg, what: str) -> list[Msg]:
        """The entity's commits from ``from_position`` up to ``newest`` (inclusive), by ``next_by_subj`` batches."""
        stop = int((newest.headers or {})[Header.SEQUENCE])
        found: list[Msg] = []
        async for msgs in self._direct.subject_pages(subject, from_position, what=what):
            for msg in msgs:
                if int((msg.headers or {})[Header.SEQUENCE]) >= stop:
                    return [*found, newest]
                found.append(msg)
        return [*found, newest]


def scan_is_cheaper(newest: int, from_position: int, previous: tuple[int, ...] | None, capacity: int) -> bool:
    """Whether a subject is read faster by one ``next_by_subj`` scan from ``from_position`` than by walking the back
    pointers of its message at ``newest`` (``previous``, ``capacity`` of them when full): the span is short, or
    the subject's recent messages lie close together (see the constants above)."""
    dense = previous is not None and len(previous) == capacity and newest - previous[-1] <= capacity * _SCAN_SPAN_PER_COMMIT
    return newest - from_position <= _SCAN_SPAN or dense


def is_commit_of(msg: Msg, escaped_key: str | None, commit_msg_id: str | None) -> bool:
    """Whether ``msg`` is a commit of the append keyed ``escaped_key`` (by its key header, or its msg id for a
    single-entity commit), or has the msg id ``commit_msg_id``; ids compare exactly."""
    headers = msg.headers or {}
    stored_id = headers.get(Header.MSG_ID)
    if commit_msg_id is not None and stored_id == commit_msg_id:
        return True
    if escaped_key is None:
        return False
    return headers.get(Header.IDEMPOTENCY_KEY, stored_id) == escaped_key

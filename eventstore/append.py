"""Appending: optimistic concurrency checked by the server, deduplication, atomic multi-entity commits.

How an append is made safe:

* **Concurrency.** Each commit carries ``Nats-Expected-Last-Subject-Sequence``:
  the stream position of the entity's last commit as the appender saw it. The
  server rejects the commit (``err_code`` 10071) if anything was written to the
  subject since. The entity's last commit is remembered from the last read or
  write of it, else looked up with one direct get (:mod:`.entity_commits`).
* **Back pointers.** Each commit also carries ``Es-Previous``: the positions
  of the entity's previous commits (see :mod:`.entity_commits`, which walks them).
* **Atomicity.** One append to one entity is one message (see :mod:`.wire`),
  stored whole or not at all. An append spanning several entities is one
  JetStream atomic batch: every entity's commit is stored, or none is.
* **Idempotency.** Every commit carries a ``Nats-Msg-Id`` derived from the
  append's id (the caller's idempotency key, escaped injectively, or a fresh
  one reused by every resend of this call); a keyed commit also carries the key
  (``Es-Idempotency-Key``). A resent commit that the server already stored is
  recognised in three ways: the server's duplicate acknowledgement; the
  server's "duplicate message id" refusal of an atomic batch; or, when the
  concurrency check fires first (it runs before deduplication), by finding this
  append's id on the commit that follows the expected position or, for a keyed
  append, anywhere on the entity. Either way the caller gets the positions and
  versions of the first write with ``duplicate=True`` and nothing is stored twice,
  and the ``note`` that write stored with its commit (a command's reply value,
  say), so a resend learns what the first call's caller learnt.
* **Every call ends.** Resends (:mod:`.sending`) after a lost acknowledgement
  back off exponentially with jitter, at most ``append_retries`` of them; an ``ANY``
  append that lost a race retries after a short jittered pause, for at most
  ``10 * request_timeout_s * (append_retries + 1)``. Then a typed error is raised. When no send was
  answered, at most half a ``request_timeout_s`` more asks the server whether it answers at all, to tell a
  lost server (:class:`ServerUnavailableError`) from one whose disk failed (:class:`StorageError`). An atomic
  append the server refuses as incomplete (it lost the staged batch) is resent the same way, and told apart
  the same way when every send was refused.
* **Size.** A commit (built by :mod:`.commit`) is checked as sent, header block included, against the
  server's ``max_payload`` before anything is sent: a larger one raises
  :class:`EventTooLargeError` (the server would close the connection on it).
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Sequence

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from .commit import Commit, EntityAppend, build_commit, check_append, check_commit_size
from .entity_commits import EntityCommits, is_commit_of
from .errors import ConcurrencyError, InvalidEventError
from .events import ANY, NO_STREAM, AppendResult
from .jetstream.direct import DirectGets
from .jetstream.inbox import Inbox
from .registry import TypeRegistry
from .sending import Conflict, Sender
from .settings import EventStoreSettings
from .wire import Header, commit_previous, escape_key, msg_id, note_of, utc_now_text

__all__ = ["Appender"]

# An ANY append that loses races keeps trying for this many times request_timeout_s * (append_retries + 1):
# every lost race is another writer's progress, so giving up early would fail appends that would succeed.
_RACE_BUDGET_FACTOR = 10


class Appender:
    """Writes commits; one per event store connection. See the module docs for the guarantees.

    Its parts serve the store's readers too: :attr:`direct` (direct gets), :attr:`entities` (what is known of
    each entity, and reading its commits) and :attr:`sender` (sending a commit, for DCB appends).
    """

    def __init__(
        self, nc: NATS, inbox: Inbox, settings: EventStoreSettings, registry: TypeRegistry, cache_size: int = 100_000
    ) -> None:
        self._nc = nc
        self._settings = settings
        self._registry = registry
        self.direct = DirectGets(inbox, settings)
        self.entities = EntityCommits(self.direct, settings, cache_size)
        self.sender = Sender(nc, inbox, settings, self.direct)

    async def _resolve_previous(self, commit: Commit) -> None:
        """Find the version and position the commit must follow, raising ConcurrencyError early when known."""
        request = commit.request
        expected = request.expected_version
        if expected is NO_STREAM or expected == 0:
            commit.prev_version, commit.prev_position = 0, 0
            return
        await self.entities.recheck(request.stream_id)
        if isinstance(expected, int) and request.expected_position is not None:
            commit.prev_version, commit.prev_position = expected, request.expected_position
            return
        known = self.entities.known(request.stream_id)
        if known is not None and (expected is ANY or known[0] == expected):
            commit.prev_version, commit.prev_position = known[0], known[1]
            return
        state = await self.entities.state(request.stream_id)
        if isinstance(expected, int) and state.version != expected:
            commit.prev_version, commit.prev_position = expected, -1  # position unknown: only "mine?" checks remain
            raise Conflict
        commit.prev_version, commit.prev_position = state.version, state.position

    async def append(
        self,
        requests: Sequence[EntityAppend],
        *,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: str | None = None,
    ) -> list[AppendResult]:
        """Append every request's events atomically (all entities or none); see the module docs."""
        key, correlation_id, causation_id = check_append(requests, idempotency_key, correlation_id, causation_id, note)
        append_id = escape_key(key) if key is not None else secrets.token_hex(16)
        single = len(requests) == 1
        prefix = self._settings.subject_prefix
        commits = [build_commit(self._registry, prefix, r, msg_id(append_id, None if single else i), key, note)
                   for i, r in enumerate(requests)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._race_budget_s()
        races = 0
        while True:
            try:
                if single:  # no gather: a task per append costs more than the lookup it would overlap
                    await self._resolve_previous(commits[0])
                else:
                    await asyncio.gather(*(self._resolve_previous(c) for c in commits))
                positions, duplicate = await self._publish(commits, correlation_id, causation_id)
                if duplicate:  # the server's duplicate ack: versions come from the stored commits
                    positions = await self._read_stored(commits, positions)
            except Conflict as conflict:
                stored = await self._find_stored(commits)
                if stored is not None:
                    positions, duplicate = stored, True
                elif conflict.duplicate_id:
                    raise self._reused_key_error(commits) from None
                elif any(c.request.expected_version is ANY for c in commits) and not await self._exact_conflict(commits):
                    # Only ANY entities moved: refresh them (unless a search just did) and try again. Losing a
                    # race is contention, not overload: short jittered pauses spread the writers out.
                    for c in commits:
                        known = self.entities.known(c.request.stream_id)
                        if known is not None and known[1] == c.prev_position:
                            self.entities.forget(c.request.stream_id)
                    races += 1
                    delay = random.uniform(0, min(0.05, 0.001 * 2**races))
                    if loop.time() + delay > deadline:
                        raise await self._race_lost_error(commits) from None
                    await asyncio.sleep(delay)
                    continue
                else:
                    raise await self._conflict_error(commits) from None
            results = [c.result(p, duplicate) for c, p in zip(commits, positions)]
            for c, r in zip(commits, results):
                self.entities.remember(r.stream_id, r.last_version, r.position, c.previous)
            return results

    async def _publish(
        self, commits: list[Commit], correlation_id: str | None, causation_id: str | None
    ) -> tuple[list[int], bool]:
        recorded_at = utc_now_text()
        for c in commits:
            c.previous = self.entities.back_pointers(c.request.stream_id, c.prev_position)
        encoded = [c.encode(recorded_at, correlation_id, causation_id) for c in commits]

        def check_size(sent: list[tuple[str, dict[str, str], bytes]]) -> None:
            for c, (_, headers, body) in zip(commits, sent):
                check_commit_size(c, headers, body, self._nc.max_payload)

        async def stored() -> bool:
            return await self._find_stored(commits) is not None

        ack = await self.sender.send(
            [(c.subject, headers, body) for c, (headers, body) in zip(commits, encoded)],
            target=str(commits[-1].request.stream_id), others=f"{len(commits) - 1} other entities",
            check_size=check_size, stored=stored,
        )
        last = int(ack["seq"])
        return [last - len(commits) + 1 + i for i in range(len(commits))], bool(ack.get("duplicate"))

    async def _find_stored(self, commits: list[Commit]) -> list[int] | None:
        """If this append was already stored (a resend or a retry), the positions of its commits; else None.

        A commit sent with an expected position can only have been stored right
        after it. A keyed append may repeat an earlier call: where its position
        is unknown, or for ``ANY`` (the earlier call may have written before the
        position now known), the entity's commits are searched, each only once
        per call; an unkeyed append's id is this call's own, so it is nowhere
        else. Finding the key on some entities but not on others means it was
        used for another append: refused.
        """
        found: list[Msg | None] = []
        for c in commits:
            msg = None
            escaped = None if c.key is None else escape_key(c.key)
            if escaped is not None and (c.prev_position < 0 or c.request.expected_version is ANY):
                # Covers the commit after the expected position: the search resumes before it.
                msg, c.searched_to = await self.entities.search(c.request.stream_id, escaped, c.msg_id, c.searched_to + 1)
            elif c.prev_position >= 0:
                msgs = await self.direct.direct_get(
                    {"seq": c.prev_position + 1, "next_by_subj": c.subject, "batch": 1},
                    what=f"Checking the append to {c.request.stream_id}",
                )
                if msgs and is_commit_of(msgs[0], escaped, c.msg_id):
                    msg = msgs[0]
            found.append(msg)
        if all(m is None for m in found):
            return None
        if any(m is None for m in found):
            raise self._reused_key_error(commits)
        return [self._adopt_stored(c, m) for c, m in zip(commits, found) if m is not None]

    async def _read_stored(self, commits: list[Commit], positions: list[int]) -> list[int]:
        """Adopt the versions of commits the server reported as duplicates (stored by an earlier call)."""
        for c, position in zip(commits, positions):
            msgs = await self.direct.direct_get(
                {"seq": position, "next_by_subj": c.subject, "batch": 1}, what=f"Reading the append to {c.request.stream_id}"
            )
            if not msgs or int((msgs[0].headers or {}).get(Header.SEQUENCE, -1)) != position or not is_commit_of(
                msgs[0], None, c.msg_id
            ):
                raise self._reused_key_error(commits)
            self._adopt_stored(c, msgs[0])
        return positions

    @staticmethod
    def _reused_key_error(commits: list[Commit]) -> InvalidEventError:
        entities = ", ".join(str(c.request.stream_id) for c in commits)
        return InvalidEventError(
            f"The idempotency key {commits[0].key!r:.60} was already used by another append (to other entities than "
            f"{entities}, or not to all of them); nothing was stored. Use one key per append."
        )

    @staticmethod
    def _adopt_stored(c: Commit, msg: Msg) -> int:
        """Make the commit describe the stored message (a retry may differ in its event count); its position."""
        headers = msg.headers or {}
        c.stored_count = headers[Header.TYPE].count(",") + 1
        c.prev_version = int(headers[Header.VERSION]) - c.stored_count
        c.previous = commit_previous(headers, c.request.stream_id)
        c.stored_note = note_of(headers)
        return int(headers[Header.SEQUENCE])

    async def _exact_conflict(self, commits: list[Commit]) -> bool:
        for c in commits:
            if c.request.expected_version is not ANY:
                state = await self.entities.state(c.request.stream_id)
                if state.version != c.prev_version or state.position != c.prev_position:
                    return True
        return False

    def _race_budget_s(self) -> float:
        return _RACE_BUDGET_FACTOR * self._settings.request_timeout_s * (self._settings.append_retries + 1)

    async def _race_lost_error(self, commits: list[Commit]) -> ConcurrencyError:
        c = next(c for c in commits if c.request.expected_version is ANY)
        state = await self.entities.state(c.request.stream_id)
        error = ConcurrencyError(c.request.stream_id, ANY, state.version)
        error.add_note(f"Other writers kept appending to {c.request.stream_id} for {self._race_budget_s()}s of retries.")
        return error

    async def _conflict_error(self, commits: list[Commit]) -> ConcurrencyError:
        for c in commits:
            expected = c.request.expected_version
            state = await self.entities.state(c.request.stream_id)
            expected_version = 0 if expected is NO_STREAM else expected
            if expected is not ANY and state.version != expected_version:
                return ConcurrencyError(c.request.stream_id, expected, state.version)
        first = commits[0]
        return ConcurrencyError(first.request.stream_id, first.request.expected_version, None)

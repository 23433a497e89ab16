"""Who serves a command subject prefix now: live workers listed in a JetStream key-value bucket.

The bucket ``cmdroutes_<prefix>`` (dots as ``_``) has a TTL (``max_age``) of ``member_ttl_s``.
Every worker of a command service puts, every third of the TTL:

* ``member.<Category>.<worker>`` for each category it serves, the value a JSON object with the
  partitions it owns (for ``status`` and the tests);
* ``partitions``: the number of partitions of the prefix, which clients read to route.

Then it lists the ``member.`` subjects the stream still holds (one stream-info request, no
consumer) and recomputes its partitions with :func:`aggregates.routing.assign`. A worker that
stops purges its keys, so the others take its partitions at their next beat; one that dies
drops out when its keys expire, within the TTL. Every request here has a deadline. Routing is
an optimisation, so nothing here stops a service from serving: a worker that cannot join yet
(the server loses replies, JetStream elects a leader) serves the plain subjects and joins at a
later beat; while the server is unreachable it keeps what it serves and says so once in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterable

from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from eventstore import InvalidArgumentError, Outage, stop_task

from .routing import assign

__all__ = ["Membership", "routing_bucket"]

log = logging.getLogger(__name__)

PARTITIONS_KEY = "partitions"


def routing_bucket(subject_prefix: str) -> str:
    """The key-value bucket that lists the workers of a command subject prefix."""
    return "cmdroutes_" + subject_prefix.replace(".", "_")


class Membership:
    """One worker's entry in its prefix's routing bucket, and the partitions it owns by it.

    ``on_change(owned)`` is awaited with the new ``{category: partitions}`` whenever they change
    (first when the worker joins). Guarantees: :meth:`start` ends within about the request timeout,
    joined or not (then the beats go on trying); it raises :class:`~eventstore.InvalidArgumentError`
    when the bucket's live workers route another number of partitions. :meth:`stop` ends within
    about the request timeout and leaves the worker unlisted when the server answers.
    """

    def __init__(
        self,
        nc: NATS,
        subject_prefix: str,
        categories: Iterable[str],
        partitions: int,
        on_change: Callable[[dict[str, frozenset[int]]], Awaitable[None]],
        *,
        member_ttl_s: float = 3.0,
        replicas: int = 1,
        timeout_s: float = 5.0,
    ) -> None:
        self.nc = nc
        self.bucket = routing_bucket(subject_prefix)
        self.categories = sorted(set(categories))
        self.partitions = partitions
        self.worker = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.member_ttl_s = member_ttl_s
        self.replicas = replicas
        self.timeout_s = timeout_s
        self._on_change = on_change
        self._owned: dict[str, frozenset[int]] = {}
        self._kv: KeyValue | None = None
        self._beats: asyncio.Task[None] | None = None
        self._outage = Outage("The command routing bucket", log)

    @property
    def owned(self) -> dict[str, frozenset[int]]:
        """The partitions this worker owns now, per category."""
        return dict(self._owned)

    async def start(self) -> None:
        try:
            async with asyncio.timeout(4 * self.timeout_s):
                await self._join()
        except InvalidArgumentError:
            raise
        except Exception as exc:  # noqa: BLE001 - routing is an optimisation: serve, and join at a later beat
            self._outage.failed(exc)
        self._beats = asyncio.create_task(self._beat_forever(), name=f"jetsourcing-membership-{self.worker}")

    async def _join(self) -> None:
        """Open (or create) the bucket, check the partition count, and beat once."""
        if self._kv is None:
            js = self.nc.jetstream(timeout=self.timeout_s)
            try:
                kv = await js.key_value(self.bucket)
            except (BadRequestError, NotFoundError):
                with contextlib.suppress(BadRequestError):  # another worker created it meanwhile
                    await js.create_key_value(
                        KeyValueConfig(bucket=self.bucket, ttl=self.member_ttl_s, history=1, replicas=self.replicas)
                    )
                kv = await js.key_value(self.bucket)
            await self._check_partitions(kv)
            self._kv = kv
        await self._beat()

    async def stop(self) -> None:
        if self._beats is not None:
            await stop_task(self._beats, timeout_s=self.timeout_s)
            self._beats = None
        if self._kv is None:
            return  # never joined: nothing to unlist
        jsm = self.nc.jsm(timeout=self.timeout_s)
        for category in self.categories:
            try:
                await jsm.purge_stream(f"KV_{self.bucket}", subject=self._subject(category))
            except Exception as exc:  # noqa: BLE001 - unlisted anyway once the TTL passes
                log.info("could not unlist worker %s from %s (it drops out within %.0fs): %r",
                         self.worker, self.bucket, self.member_ttl_s, exc)
                break

    async def _check_partitions(self, kv: KeyValue) -> None:
        try:
            entry = await kv.get(PARTITIONS_KEY)
        except KeyNotFoundError:
            return
        theirs = int(entry.value or b"0")
        if theirs != self.partitions and any(await self._members_by_category()):
            raise InvalidArgumentError(
                f"The command services on this subject prefix route {theirs} partitions, this one {self.partitions}: "
                f"give every service of the prefix the same partitions (JETSOURCING_COMMAND_PARTITIONS), or stop "
                f"the others first."
            )

    def _subject(self, category: str) -> str:
        return f"$KV.{self.bucket}.member.{category}.{self.worker}"

    async def _members_by_category(self) -> dict[str, set[str]]:
        info = await self.nc.jsm(timeout=self.timeout_s).stream_info(
            f"KV_{self.bucket}", subjects_filter=f"$KV.{self.bucket}.member.>"
        )
        members: dict[str, set[str]] = {}
        for subject in (info.state.subjects or {}):
            category, worker = subject.split(".")[-2:]
            members.setdefault(category, set()).add(worker)
        return members

    async def _beat(self) -> None:
        assert self._kv is not None
        await self._kv.put(PARTITIONS_KEY, str(self.partitions).encode())
        for category in self.categories:
            value = {"host": socket.gethostname(), "pid": os.getpid(),
                     "owned": sorted(self._owned.get(category, ()))}
            await self._kv.put(f"member.{category}.{self.worker}", json.dumps(value).encode())
        members = await self._members_by_category()
        owned = {
            category: assign(members.get(category, set()) | {self.worker}, self.partitions)[self.worker]
            for category in self.categories
        }
        if owned != self._owned:
            self._owned = owned
            await self._on_change(owned)

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.member_ttl_s / 3)
            try:
                async with asyncio.timeout(4 * self.timeout_s):
                    await self._join()
            except asyncio.CancelledError:
                raise
            except InvalidArgumentError as exc:
                log.error("%s Serving on the plain subjects only.", exc)
                return
            except Exception as exc:  # noqa: BLE001 - keep serving what we own; the next beat tries again
                self._outage.failed(exc)
            else:
                self._outage.succeeded()

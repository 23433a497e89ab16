"""Leases in a JetStream key-value bucket: at most one daemon applies a projection to a read-model store.

A lease is the KV key ``<store id>.<projection>`` created with "create only
if absent" and holding the owner's id. The bucket's TTL (``max_age``) makes
an abandoned lease expire; the holder renews it every TTL/3 with a
compare-and-set on the revision it last wrote. A second daemon polls until
the key is gone (released, or expired because the holder died) and then
creates it: it takes over within one TTL of the holder's death.

A lease is only an optimisation against wasted work. Correctness does not
depend on it: every batch commit in the read-model store is a
compare-and-set on (checkpoint, owner), so a paused holder that wakes after
losing its lease cannot apply anything twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid

from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from eventstore import Backoff, stop_task
from eventstore.errors import map_nats_error
from eventstore.jetstream import ErrorCode, ride_out_jetstream

from .errors import LeaseError

__all__ = ["Lease", "new_owner_id", "open_lease_bucket"]

log = logging.getLogger("projections")



def new_owner_id() -> str:
    """A unique id for one daemon or rebuild: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


async def open_lease_bucket(
    nc: NATS,
    bucket: str,
    ttl_s: float,
    timeout_s: float = 5.0,
    replicas: int = 1,
    *,
    limit_s: float | None = 0.0,
    stop: asyncio.Event | None = None,
) -> tuple[KeyValue, float]:
    """The lease bucket (created with ``ttl_s`` and ``replicas`` if missing) and its actual TTL in seconds.

    An existing bucket keeps its own TTL: every daemon sharing it must agree.
    ``replicas`` should be the event stream's, so that leases survive what the
    stream survives (the loss of a node of an R3 cluster).

    A server that does not answer within ``timeout_s``, or answers "not now"
    (an election), is asked again with backoff while the failures last less
    than ``limit_s`` seconds (a long-running process passes its outage policy,
    ``outage_limit_s``; None: for ever; the default 0: one attempt) and
    ``stop`` is not set; then :class:`~eventstore.ServerUnavailableError`.
    """
    return await ride_out_jetstream(
        lambda: _open_lease_bucket(nc, bucket, ttl_s, timeout_s, replicas), what=f"Opening the lease bucket {bucket!r}",
        logger=log, timeout_s=timeout_s, requests=3, limit_s=limit_s, stop=stop,  # a create, or two reads
    )


async def _open_lease_bucket(
    nc: NATS, bucket: str, ttl_s: float, timeout_s: float, replicas: int
) -> tuple[KeyValue, float]:
    js = nc.jetstream(timeout=timeout_s)
    try:
        with map_nats_error(f"Creating the lease bucket {bucket!r}", timeout_s):
            kv = await js.create_key_value(KeyValueConfig(bucket=bucket, ttl=ttl_s, history=1, replicas=replicas))
        return kv, ttl_s
    except BadRequestError as exc:
        if exc.err_code != ErrorCode.STREAM_NAME_IN_USE:
            raise LeaseError(f"Could not create the lease bucket {bucket!r}: {exc}") from exc
    with map_nats_error(f"Reading the lease bucket {bucket!r}", timeout_s):
        kv = await js.key_value(bucket)
        status = await kv.status()
    ttl = float(status.ttl or 0)
    if ttl <= 0:
        raise LeaseError(
            f"Lease bucket {bucket!r} exists without a TTL, so a dead daemon's lease would never expire. "
            "Delete it (nats kv del --force) or choose another lease_bucket."
        )
    if ttl != ttl_s:
        log.info("Lease bucket %r has a TTL of %.1fs (not the configured %.1fs); using it.", bucket, ttl, ttl_s)
    return kv, ttl


class Lease:
    """One lease: ``acquire`` (waiting), keep alive in the background, ``release``.

    Guarantees: while :attr:`lost` is not set, no other owner has created the
    key since this one did (as far as the server has answered); ``lost`` is
    set as soon as a renewal finds another owner. :meth:`release` always
    returns, within about twice ``request_timeout_s`` plus a second, and
    after it returns nothing renews the lease any more.
    """

    def __init__(self, kv: KeyValue, key: str, owner: str, ttl_s: float, *, request_timeout_s: float = 5.0) -> None:
        self.kv = kv
        self.key = key
        self.owner = owner
        self.ttl_s = ttl_s
        self.request_timeout_s = request_timeout_s
        self.revision: int | None = None
        self.lost = asyncio.Event()
        self._stopping = asyncio.Event()
        self._keepalive: asyncio.Task[None] | None = None

    @property
    def held(self) -> bool:
        """True while this owner holds the lease (as far as it knows)."""
        return self.revision is not None and not self.lost.is_set()

    async def holder(self) -> str | None:
        """The current holder's owner id, or None when the lease is free."""
        try:
            async with asyncio.timeout(self.request_timeout_s):
                entry = await self.kv.get(self.key)
        except KeyNotFoundError:  # also KeyDeletedError
            return None
        return entry.value.decode() if entry.value else None

    async def try_acquire(self) -> bool:
        """Take the lease if it is free; True on success (then it is kept alive until :meth:`release`)."""
        try:
            async with asyncio.timeout(self.request_timeout_s):
                self.revision = await self.kv.create(self.key, self.owner.encode())
        except KeyWrongLastSequenceError:
            return False
        self.lost = asyncio.Event()
        self._stopping = asyncio.Event()
        self._keepalive = asyncio.create_task(self._keep_alive(self._stopping), name=f"lease {self.key}")
        return True

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until the lease is ours (True) or ``stop`` is set (False). Survives server outages."""
        announced = None
        backoff = Backoff(f"{self.key}: taking the lease", log, cap_s=max(self.ttl_s, 1.0))
        while not stop.is_set():
            delay = min(self.ttl_s / 4, 1.0)
            try:
                if await self.try_acquire():
                    backoff.succeeded()
                    if announced:
                        log.info("%s: took over the lease from %s.", self.key, announced)
                    return True
                holder = await self.holder()
                backoff.succeeded()
                if holder and holder != announced:
                    log.info("%s: held by %s; waiting to take over (TTL %.1fs).", self.key, holder, self.ttl_s)
                    announced = holder
            except Exception as exc:  # noqa: BLE001 - server unreachable: keep trying until stopped
                delay = backoff.failed(exc)
            await _wait(stop, delay)
        return False

    async def confirm(self) -> bool:
        """Renew now and return whether the lease is still ours (False also sets :attr:`lost`).

        Used before re-claiming a read model after a checkpoint conflict, so two
        daemons never take a read model from each other in turns.
        """
        if not self.held:
            return False
        # As a renewal: a "wrong last sequence" is not proof of a loss (a keep-alive renewal landed first, or, on a
        # replicated bucket, is still in flight: err_code 10164, which nats-py reports as that too); the key's
        # owner decides.
        await self._renew()
        return not self.lost.is_set()

    async def _keep_alive(self, stopping: asyncio.Event) -> None:
        # The loop ends on its own flag, checked after every await: a cancellation alone can be lost inside a
        # nats-py request (see eventstore.tasks), and then a loop that waits only for it renews forever.
        interval = self.ttl_s / 3
        backoff = Backoff(f"{self.key}: renewing the lease", log, cap_s=interval)
        delay = interval
        while not await _wait(stopping, delay):
            try:
                await self._renew()
                backoff.succeeded()
                delay = interval
            except Exception as exc:  # noqa: BLE001 - a restarting server: try again soon
                delay = backoff.failed(exc)
            if self.lost.is_set():
                return

    async def _renew(self) -> None:
        """One renewal; sets :attr:`lost` if another owner has the key."""
        try:
            async with asyncio.timeout(self.request_timeout_s):
                self.revision = await self.kv.update(self.key, self.owner.encode(), last=self.revision)
            return
        except KeyWrongLastSequenceError:
            pass
        # Our revision is not the last: the key expired (e.g. during a long outage) or someone took it.
        try:
            async with asyncio.timeout(self.request_timeout_s):
                try:
                    entry = await self.kv.get(self.key)
                except KeyNotFoundError:
                    entry = None
                if entry is not None and entry.value == self.owner.encode():
                    self.revision = entry.revision  # our renewal landed but its answer was lost
                    return
                if entry is None:
                    self.revision = await self.kv.create(self.key, self.owner.encode())
                    log.info("%s: lease had expired; re-acquired it.", self.key)
                    return
                holder = entry.value.decode() if entry.value else "another daemon"
        except KeyWrongLastSequenceError:
            holder = "another daemon"
        log.warning("%s: lease lost to %s; stopping work on it.", self.key, holder)
        self.lost.set()

    async def release(self) -> None:
        """Stop renewing and delete the key (if still ours), so a waiting daemon takes over at once.

        Bounded: a renewal in flight may finish (so the revision to delete is
        right) for at most ``request_timeout_s``; then the keep-alive is
        cancelled until it ends. A key that cannot be deleted expires after the TTL.
        """
        self._stopping.set()
        task, self._keepalive = self._keepalive, None
        if task is not None:
            await stop_task(task, grace_s=self.request_timeout_s, timeout_s=self.request_timeout_s + 1.0)
        revision, self.revision = self.revision, None
        if revision is not None and not self.lost.is_set():
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    await self.kv.delete(self.key, last=revision)
            except Exception as exc:  # noqa: BLE001 - the key expires after the TTL anyway
                log.debug("%s: could not delete the lease (%s); it expires after %.1fs.", self.key, exc, self.ttl_s)


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``event``; True if it is set."""
    if timeout_s > 0 and not event.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):  # unlike wait_for, never swallows a cancellation
                await event.wait()
    return event.is_set()

"""Snapshots: an aggregate's state at a version, kept in a JetStream key-value bucket to shorten loads.

Layout: one bucket per event store stream, ``<stream>_snapshots`` (history 1,
file storage, direct get), one key per aggregate, ``<Category>.<id token>``,
holding JSON ``{"fingerprint", "version", "position", "state", "commands"}``
(``commands``: the aggregate's command ids, so a load from a snapshot still
knows every command applied before it).

Snapshots are only ever an optimisation, so they can never change a result:

* A snapshot is used only if its ``fingerprint`` matches the aggregate's: a
  hash of the state model's JSON schema and the repository's
  ``snapshot_version``. A snapshot written by another schema is ignored and the
  aggregate is replayed in full. Bump ``snapshot_version`` when a handler's
  logic changes but the state model does not.
* Any failure to read one (missing bucket, bad JSON, state that no longer
  validates, a record without ``commands`` from an older version) means a full replay; any failure to write one is logged and the
  command carries on. A deleted bucket is created again on the next write.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from eventstore import EventStore, ServerUnavailableError
from eventstore.errors import map_nats_error
from eventstore.jetstream import ride_out_jetstream

__all__ = ["Snapshot", "SnapshotStore", "bucket_name", "fingerprint"]

log = logging.getLogger("jetsourcing.aggregates")

S = TypeVar("S", bound=BaseModel)

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def bucket_name(stream: str) -> str:
    """The snapshot bucket of the event store stream ``stream``."""
    return f"{stream}_snapshots"


def fingerprint(state_type: type[BaseModel], snapshot_version: int) -> str:
    """A short hash that changes whenever the state model's schema or ``snapshot_version`` changes."""
    try:
        schema = json.dumps(state_type.model_json_schema(), sort_keys=True)
    except Exception:  # noqa: BLE001 - a model without a JSON schema still has fields
        schema = repr(sorted((name, repr(field)) for name, field in state_type.model_fields.items()))
    digest = hashlib.sha256(f"{snapshot_version}\n{state_type.__qualname__}\n{schema}".encode())
    return digest.hexdigest()[:16]


def _key(category: str, aggregate_id: str) -> str:
    # KV keys allow [-/_=.A-Za-z0-9]; other ids are base64url-encoded behind a '=' that plain ids never contain.
    if _PLAIN_KEY.fullmatch(aggregate_id):
        return f"{category}.{aggregate_id}"
    return f"{category}.={base64.urlsafe_b64encode(aggregate_id.encode()).decode().rstrip('=')}"


@dataclass(frozen=True, slots=True)
class Snapshot(Generic[S]):
    """An aggregate's ``state`` after its event ``version``, the last event of the commit at ``position``, and the
    command ids applied up to there (see :attr:`Aggregate.commands`)."""

    version: int
    position: int
    state: S
    commands: dict[str, tuple[int, int]]


class _Record(BaseModel):
    fingerprint: str
    version: int
    position: int
    state: dict[str, Any]
    commands: dict[str, tuple[int, int]] | None = None  # None: written before snapshots kept command ids


class SnapshotStore(Generic[S]):
    """Reads and writes one aggregate type's snapshots; never raises (failures are logged)."""

    def __init__(
        self, store: EventStore, category: str, state_type: type[S], *, every: int, snapshot_version: int = 1
    ) -> None:
        if every < 1:
            raise ValueError(f"snapshot_every must be >= 1, not {every}.")
        self.store = store
        self.category = category
        self.state_type = state_type
        self.every = every
        self.bucket = bucket_name(store.settings.stream)
        self.fingerprint = fingerprint(state_type, snapshot_version)
        self._kv: KeyValue | None = None
        self._lock = asyncio.Lock()

    def due(self, before: int, after: int) -> bool:
        """True when going from version ``before`` to ``after`` crossed a multiple of ``every``."""
        return after // self.every > before // self.every

    async def _bucket(self, create: bool) -> KeyValue | None:
        if self._kv is not None:
            return self._kv
        async with self._lock:
            if self._kv is None:
                js = self.store.nc.jetstream(timeout=self.store.settings.request_timeout_s)
                try:
                    self._kv = await js.key_value(self.bucket)
                except BucketNotFoundError:
                    if not create:
                        return None
                    self._kv = await js.create_key_value(
                        KeyValueConfig(
                            bucket=self.bucket,
                            history=1,
                            storage=StorageType.FILE,
                            direct=True,
                            replicas=self.store.settings.replicas,
                        )
                    )
            return self._kv

    async def open(self, *, long_running: bool = False, stop: asyncio.Event | None = None) -> bool:
        """Open the bucket now, creating it if missing, so the first commands find it; True once it is open.

        A JetStream that elects a leader or loses replies is waited out, for
        about ``request_timeout_s``, or with ``long_running`` (a service's
        start) as the outage policy says (``outage_limit_s``), until ``stop``.
        Never raises: a bucket that cannot be opened is logged, and the
        commands open it as they need it (or replay in full meanwhile).
        """
        settings = self.store.settings
        try:
            await ride_out_jetstream(
                lambda: self._bucket(create=True), what=f"Opening the snapshot bucket {self.bucket!r}", logger=log,
                timeout_s=settings.request_timeout_s, requests=2,  # a read, then a create
                limit_s=settings.outage_limit_s if long_running else 0.0, stop=stop,
            )
        except Exception as exc:  # noqa: BLE001 - snapshots are optional: the commands go on without
            log.warning("%s; the commands open it when they need it.", exc)
            return False
        return True

    async def get(self, aggregate_id: str) -> Snapshot[S] | None:
        """The aggregate's snapshot if there is a usable one, else None (within about ``request_timeout_s``)."""
        what = f"Reading the snapshot of {self.category} {aggregate_id!r}"
        try:
            with map_nats_error(what, self.store.settings.request_timeout_s):
                kv = await self._bucket(create=False)
                if kv is None:
                    return None
                entry = await kv.get(_key(self.category, aggregate_id))
        except KeyNotFoundError:
            return None
        except ServerUnavailableError as exc:  # names the operation already
            self._kv = None
            log.warning("%s; replaying all events.", exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a snapshot is optional: fall back to a full replay
            self._kv = None
            log.warning("%s failed (%s); replaying all events.", what, exc)
            return None
        try:
            record = _Record.model_validate_json(entry.value or b"")
            if record.commands is None:
                log.info("Ignoring the snapshot of %s %r: it predates command ids in snapshots.", self.category, aggregate_id)
                return None
            if record.fingerprint != self.fingerprint:
                log.info(
                    "Ignoring the snapshot of %s %r: it was written for another state schema.", self.category, aggregate_id
                )
                return None
            state = self.state_type.model_validate(record.state)
            return Snapshot(record.version, record.position, state, record.commands)
        except ValidationError as exc:
            log.warning("Ignoring an unreadable snapshot of %s %r: %s", self.category, aggregate_id, exc)
            return None

    async def put(
        self, aggregate_id: str, version: int, position: int, state: BaseModel, commands: dict[str, tuple[int, int]]
    ) -> None:
        """Store ``state`` and ``commands`` as the aggregate's snapshot at ``version``/``position``; logs instead of raising.

        Ends within about ``request_timeout_s`` when the server does not answer.
        """
        what = f"Writing the snapshot of {self.category} {aggregate_id!r} at version {version}"
        try:
            record = _Record(
                fingerprint=self.fingerprint,
                version=version,
                position=position,
                state=state.model_dump(mode="json"),
                commands=commands,
            )
            with map_nats_error(what, self.store.settings.request_timeout_s):
                kv = await self._bucket(create=True)
                assert kv is not None
                await kv.put(_key(self.category, aggregate_id), record.model_dump_json().encode())
        except ServerUnavailableError as exc:  # names the operation already
            self._kv = None
            log.warning("%s", exc)
        except Exception as exc:  # noqa: BLE001 - a failed snapshot must never fail the command
            self._kv = None
            log.warning("%s failed: %s", what, exc)

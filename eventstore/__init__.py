"""jetsourcing's event store on NATS JetStream.

If you are here to read the code, start with ``store.py`` (the :class:`EventStore`
facade), then ``append.py`` (optimistic concurrency, idempotency, atomic
commits; built on ``commit.py``, ``entity_commits.py``, ``sending.py`` and ``jetstream/direct.py``), ``wire.py`` (the message layout), ``reading.py`` (loading one entity,
replaying the stream), ``jetstream/`` (JetStream's API subjects and error
codes, the ordered replay and its bulk-read connection), ``server.py`` and ``cluster.py`` (the embedded
nats-server, and a cluster of them), ``security.py`` and ``connection.py`` (credentials, TLS, and the
nats-py connection), ``validation.py`` (the public arguments' checks),
``stream_check.py`` (which stream settings keep acknowledged events),
``tasks.py`` (stopping background tasks for sure, retry backoff) and
``errors.py``. Dynamic consistency boundaries (tagged events, queries, conditions the server checks):
``dcb.py``, then ``dcb_jetstream.py`` and ``dcb_memory.py``.
"""

from .cluster import EmbeddedCluster
from .commit import MAX_ENTITIES_PER_APPEND, EntityAppend
from .dcb import AppendCondition, DcbLog, Query, QueryItem, QueryResult, SequencedEvent, TaggedEvent
from .dcb_jetstream import JetStreamDcb
from .dcb_memory import InMemoryDcb
from .errors import (
    AppendConditionError,
    AuthenticationError,
    ConcurrencyError,
    EventDecodeError,
    EventStoreClosedError,
    EventStoreError,
    EventTooLargeError,
    HistoryGapError,
    ImportPathError,
    InvalidArgumentError,
    InvalidEventError,
    InvalidStreamIdError,
    ServerUnavailableError,
    StorageError,
    StreamConfigError,
    UncheckableQueryError,
    UnknownEventTypeError,
)
from .loading import import_object
from .events import ANY, NO_STREAM, AppendResult, ExpectedVersion, RecordedEvent, StreamState
from .reading import Replayed, StoredMessage
from .registry import TypeRegistry, Upcaster
from .security import ConnectionSecurity, connect_options
from .server import EmbeddedServer, find_nats_server
from .settings import EventStoreSettings
from .store import EntityInfo, EventStore, Pending, StoreInfo
from .log import EventLog
from .memory import InMemoryEventStore
from .streams import StreamId, decode_entity_id, encode_entity_id
from .tasks import Backoff, Outage, ride_out, stop_task
from .wire import Header, decode_commit, encode_commit

__all__ = [
    "ANY",
    "AppendCondition",
    "AppendConditionError",
    "AppendResult",
    "AuthenticationError",
    "Backoff",
    "ConcurrencyError",
    "ConnectionSecurity",
    "DcbLog",
    "EmbeddedCluster",
    "EmbeddedServer",
    "EntityAppend",
    "EntityInfo",
    "EventDecodeError",
    "EventLog",
    "EventStore",
    "EventStoreClosedError",
    "EventStoreError",
    "EventStoreSettings",
    "EventTooLargeError",
    "ExpectedVersion",
    "Header",
    "HistoryGapError",
    "ImportPathError",
    "InMemoryDcb",
    "InMemoryEventStore",
    "InvalidArgumentError",
    "InvalidEventError",
    "InvalidStreamIdError",
    "JetStreamDcb",
    "MAX_ENTITIES_PER_APPEND",
    "NO_STREAM",
    "Outage",
    "Pending",
    "Query",
    "QueryItem",
    "QueryResult",
    "RecordedEvent",
    "Replayed",
    "SequencedEvent",
    "ServerUnavailableError",
    "StorageError",
    "StoreInfo",
    "StoredMessage",
    "StreamConfigError",
    "StreamId",
    "StreamState",
    "TaggedEvent",
    "TypeRegistry",
    "UncheckableQueryError",
    "UnknownEventTypeError",
    "Upcaster",
    "connect_options",
    "decode_commit",
    "decode_entity_id",
    "encode_commit",
    "encode_entity_id",
    "find_nats_server",
    "import_object",
    "ride_out",
    "stop_task",
]

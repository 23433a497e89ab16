"""JetStream's API subjects and the error codes the framework acts on, in one place.

Every request the framework sends to JetStream goes to a subject built here;
no other module spells ``$JS.API``. The codes are nats-server's ``err_code``
values (``server/errors.json``), named for what the framework does with them.
"""

from __future__ import annotations

from typing import Final

__all__ = ["API_PREFIX", "ACK_PREFIX", "ErrorCode", "TRANSIENT_API_ERRORS", "Subjects"]

API_PREFIX: Final = "$JS.API"
"""Where JetStream listens for API requests (an account with a JetStream domain may use another prefix)."""

ACK_PREFIX: Final = "$JS.ACK"
"""How the reply subject of every message a consumer delivers begins: ``$JS.ACK.<stream>.<consumer>.<numbers>``."""


class ErrorCode:
    """The ``err_code`` values of JetStream's answers that the framework tells apart."""

    NO_SUITABLE_PEERS: Final = 10005  # "no suitable peers for placement": e.g. a new meta leader that sees peers offline
    JETSTREAM_UNAVAILABLE: Final = 10008  # "temporarily unavailable": no meta or stream leader just now
    CLUSTER_CANNOT_HANDLE: Final = 10009  # "cluster can not handle request": between leaders
    CONSUMER_EXISTS: Final = 10013  # the name is taken by a consumer with another configuration
    CONSUMER_NOT_FOUND: Final = 10014
    INSUFFICIENT_RESOURCES: Final = 10023  # the server's JetStream storage limit is reached
    MESSAGE_TOO_LARGE: Final = 10054
    STREAM_NAME_IN_USE: Final = 10058
    STREAM_NOT_FOUND: Final = 10059
    WRONG_LAST_SEQUENCE: Final = 10071
    STREAM_FULL: Final = 10077  # max_msgs / max_bytes reached with discard new
    STREAM_OFFLINE: Final = 10118  # every server of the stream's group is offline (10194 adds a reason: unsupported)
    CONSUMER_OFFLINE: Final = 10119  # every server of the consumer's group is offline (10195: unsupported)
    CONSUMER_ALREADY_EXISTS: Final = 10148
    MSG_ID_IN_PROCESS: Final = 10158  # a write with this message id is being replicated
    LAST_SEQUENCE_UNKNOWN: Final = 10163  # the subject's last sequence is not known yet
    SUBJECT_WRITE_IN_PROCESS: Final = 10164  # a write to this subject is being replicated (not a conflict)
    ATOMIC_DISABLED: Final = 10174
    BATCH_INCOMPLETE: Final = 10176  # the server lost staged messages of the batch (a restart, a failed write)
    BATCH_DUPLICATE_MSG_ID: Final = 10201
    BATCH_TOO_MANY_INFLIGHT: Final = 10210


TRANSIENT_API_ERRORS: Final = frozenset({
    ErrorCode.NO_SUITABLE_PEERS,
    ErrorCode.JETSTREAM_UNAVAILABLE,
    ErrorCode.CLUSTER_CANNOT_HANDLE,
    ErrorCode.STREAM_OFFLINE,
    ErrorCode.CONSUMER_OFFLINE,
})
"""JetStream's "not now": answers of a cluster that is between leaders, or whose servers are (seen as) offline.

Nothing was done; the same request may succeed a moment later (after an
election: a new meta leader learns which peers are online from their next
heartbeat, and refuses placements meanwhile). A cluster that stays short of
servers keeps answering so: callers bound how long they ask again."""


class Subjects:
    """The API subjects of one stream under an API prefix (``$JS.API`` by default)."""

    __slots__ = ("prefix", "stream")

    def __init__(self, stream: str, prefix: str = API_PREFIX) -> None:
        self.stream = stream
        self.prefix = prefix

    def stream_create(self) -> str:
        return f"{self.prefix}.STREAM.CREATE.{self.stream}"

    def stream_info(self) -> str:
        return f"{self.prefix}.STREAM.INFO.{self.stream}"

    def stream_update(self) -> str:
        return f"{self.prefix}.STREAM.UPDATE.{self.stream}"

    def stream_delete(self) -> str:
        return f"{self.prefix}.STREAM.DELETE.{self.stream}"

    def msg_get(self) -> str:
        """A message get, answered by the stream's leader (so it sees the newest write)."""
        return f"{self.prefix}.STREAM.MSG.GET.{self.stream}"

    def direct_get(self) -> str:
        """A direct get, answered by any replica (fast; on a cluster it may lag the leader)."""
        return f"{self.prefix}.DIRECT.GET.{self.stream}"

    def consumer_create(self, name: str) -> str:
        return f"{self.prefix}.CONSUMER.CREATE.{self.stream}.{name}"

    def consumer_info(self, name: str) -> str:
        return f"{self.prefix}.CONSUMER.INFO.{self.stream}.{name}"

    def consumer_list(self) -> str:
        """The stream's consumers with their state, a page (``offset``) at a time."""
        return f"{self.prefix}.CONSUMER.LIST.{self.stream}"

    def consumer_delete(self, name: str) -> str:
        return f"{self.prefix}.CONSUMER.DELETE.{self.stream}.{name}"

    def consumer_next(self, name: str) -> str:
        """Where pull requests for consumer ``name`` go."""
        return f"{self.prefix}.CONSUMER.MSG.NEXT.{self.stream}.{name}"

    def ack_prefix(self, consumer: str) -> str:
        """How the reply subject of each message ``consumer`` delivers begins, up to its numbers."""
        return f"{ACK_PREFIX}.{self.stream}.{consumer}."

    def max_deliveries_advisory(self, consumer: str) -> str:
        """Where the server announces a message that reached the consumer's ``max_deliver``."""
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.stream}.{consumer}"

"""The JetStream wire: API subjects and error codes, the ordered replay, the bulk-read transport, direct gets
(:mod:`.direct`), and the retry that waits out an election (:mod:`.not_now`).

Everything that speaks JetStream's protocol below nats-py's public client
lives here, once; the rest of the framework goes through these modules.
"""

from .durable import ConsumerAnswer, DurableConsumer
from .boundaries import last_commit_boundary, whole_commits_end
from .api import API_PREFIX, ErrorCode, Subjects, TRANSIENT_API_ERRORS
from .not_now import not_now, ride_out_jetstream
from .replay import Commits, NativeRun, OrderedReplay, Parsed, Part, Scanner, leader_has_message
from .shared import SharedConnection
from .transport import BulkConnection, Raw, Receiver

__all__ = [
    "API_PREFIX", "BulkConnection", "Commits", "ConsumerAnswer", "DurableConsumer", "ErrorCode", "NativeRun", "OrderedReplay", "Parsed", "Part", "Raw", "Receiver",
    "Scanner", "SharedConnection", "Subjects", "TRANSIENT_API_ERRORS", "last_commit_boundary", "leader_has_message",
    "not_now", "ride_out_jetstream", "whole_commits_end",
]

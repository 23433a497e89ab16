"""How a command and its answer travel over NATS request-reply: the subject, the request, the reply.

* Subject: ``<prefix>.<Category>.<Command>``, e.g. ``cmd.Account.Deposit``
  (the prefix is the service's and client's ``subject_prefix``, default ``cmd``).
* Request body: JSON ``{"aggregate_id": "...", "command": {...the command model's fields...}}``.
  Headers: ``Jetsourcing-Command-Id`` (the command's idempotency id) and,
  optionally, ``Jetsourcing-Correlation-Id``.
* Reply body: JSON ``{"ok": true, "version": 3, "position": 1042, "duplicate": false,
  "command_id": "..."}``, or ``{"ok": false, "error": KIND, "message": "...",
  "type": "..."}`` where KIND is one of :data:`ERROR_KINDS`.
"""

from __future__ import annotations

import re
from typing import Final

from eventstore import InvalidArgumentError

__all__ = [
    "COMMAND_ID_HEADER", "CORRELATION_ID_HEADER", "ERROR_KINDS", "check_name", "check_prefix", "command_subject",
]

COMMAND_ID_HEADER: Final = "Jetsourcing-Command-Id"
CORRELATION_ID_HEADER: Final = "Jetsourcing-Correlation-Id"

ERROR_KINDS: Final = ("domain", "not_found", "exists", "invalid", "conflict", "unavailable", "failed")
"""What a failed command's reply says went wrong, mapped to one exception class each by the client."""

_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){0,7}")


def check_name(name: object, what: str = "command name") -> str:
    """``name`` if it can be one subject token (a letter, then letters, digits, ``_`` or ``-``; at most 64)."""
    return _checked(_TOKEN, name, f"Invalid {what} {name!r:.80}: it must start with a letter and hold only letters, "
                    "digits, '_' or '-' (at most 64 characters), e.g. 'Deposit'.")


def check_prefix(prefix: object) -> str:
    """``prefix`` if it can start a command subject: dot-separated tokens without wildcards or spaces."""
    return _checked(_PREFIX, prefix, f"Invalid command subject prefix {prefix!r:.80}: use one or more dot-separated "
                    "tokens of letters, digits, '_' or '-' (no spaces, no '*' or '>'), e.g. 'cmd' or 'bank.cmd'.")


def _checked(pattern: re.Pattern[str], value: object, message: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidArgumentError(message)
    return value


def command_subject(prefix: str, category: str, command: str) -> str:
    """The subject that commands named ``command`` to aggregates of ``category`` are sent on."""
    return f"{prefix}.{category}.{command}"

"""How a command and its answer travel over NATS request-reply: the subject, the request, the reply.

* Subject: ``<prefix>.<Category>.<Command>``, e.g. ``cmd.Account.Deposit``
  (the prefix is the service's and client's ``subject_prefix``, default ``cmd``).
* Request body: a JSON object ``{"aggregate_id": "...", "command": {...the command model's fields...}}``,
  UTF-8, strict JSON (no ``NaN`` or ``Infinity``, no number too large for a float or longer than 4,300 digits,
  nested less deeply than Python's recursion limit allows).
* Request headers: ``Jetsourcing-Command-Id`` (required: the command's idempotency id) and, optionally,
  ``Jetsourcing-Correlation-Id``. Header names match in any case (``jetsourcing-command-id`` too).
* Size: the server takes a request whose header block and body together are at most its ``max_payload``
  bytes (the subject and reply inbox travel on the control line, limited separately by ``max_control_line``,
  4,096 bytes by default; the names :func:`check_name` and :func:`check_prefix` accept stay far below it).
  A larger one closes the sender's connection, so :class:`~aggregates.CommandClient` refuses it before
  sending.
* Reply body: JSON ``{"ok": true, "version": 3, "position": 1042, "duplicate": false,
  "command_id": "...", "value": ...}``, or ``{"ok": false, "error": KIND, "message": "...",
  "type": "..."}`` where KIND is one of :data:`ERROR_KINDS`.

Every request with a reply subject gets exactly one reply. An ``ok`` reply says the command is stored (or, with
``duplicate``, was stored by an earlier request with the same id). ``value`` is what the handler returned, as
JSON, absent when it returned None. When the handler returned a value that is not sent, the reply is still
``ok`` and carries ``"value_error"``: why (it is not JSON-serialisable, the reply would exceed ``max_payload``,
or, for a duplicate, the first run's value was larger than the :data:`~eventstore.wire.MAX_NOTE_BYTES` kept for
resends). A duplicate's reply carries the value the first run returned: it is stored with the command's commit.

**Command ids.** The service refuses, as ``invalid`` (nothing runs), a request whose command id is missing,
empty, sent twice under differently cased names, or not valid UTF-8 (a value that holds U+FFFD, which is what
invalid bytes decode to: two different invalid ids would otherwise be taken for one). Idempotency is never
silently off: set the header to a new unique id (a UUID) for each command, and send the same id again when
resending it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from eventstore import InvalidArgumentError

__all__ = [
    "COMMAND_ID_HEADER", "CORRELATION_ID_HEADER", "ERROR_KINDS", "check_name", "check_prefix", "command_subject",
    "request_ids",
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


def request_ids(headers: Mapping[str, str] | None) -> tuple[str, str | None]:
    """The request's command id and correlation id (None when absent or empty), read by the rules above.

    Raises :class:`~eventstore.InvalidArgumentError` saying how to set the command id when it is not usable.
    """
    command_id = _header(headers, COMMAND_ID_HEADER)
    how = (f"Set the {COMMAND_ID_HEADER} header to a new unique id (a UUID) for each command, and send the same id "
           "again when resending it: it makes the command run at most once. Nothing ran.")
    if command_id is None:
        raise InvalidArgumentError(f"The request has no {COMMAND_ID_HEADER} header. {how}")
    if not command_id:
        raise InvalidArgumentError(f"The request's {COMMAND_ID_HEADER} header is empty. {how}")
    if "\ufffd" in command_id:
        raise InvalidArgumentError(
            f"The request's {COMMAND_ID_HEADER} header is not valid UTF-8 (or holds U+FFFD), so it cannot tell this "
            f"command from another. {how}"
        )
    return command_id, _header(headers, CORRELATION_ID_HEADER) or None


def _header(headers: Mapping[str, str] | None, name: str) -> str | None:
    """The value of header ``name`` in any case; two differently cased copies are refused, being ambiguous."""
    if not headers:
        return None
    wanted = name.lower()
    found = [key for key in headers if key.lower() == wanted]
    if len(found) > 1:
        raise InvalidArgumentError(
            f"The request carries {name} twice, as {' and '.join(sorted(found))}: send it once. Nothing ran."
        )
    return headers[found[0]] if found else None

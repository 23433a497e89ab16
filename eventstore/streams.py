"""Stream ids: which entity an event belongs to, and the NATS subject that holds it.

Every entity has its own subject, ``<prefix>.<Category>.<entity id>``.

* A **category** must be a plain identifier (``[A-Za-z][A-Za-z0-9_-]*``, at most
  64 characters); anything else is rejected with :class:`InvalidStreamIdError`.
* An **entity id** may be any non-empty string of at most 256 characters without
  control characters or lone surrogates. It is encoded reversibly into one subject token: printable
  ASCII passes through, while ``.``, ``*``, ``>``, ``%``, whitespace and
  non-ASCII characters become ``%XX`` escapes of their UTF-8 bytes (so
  ``alice@example.com`` is stored as ``alice@example%2Ecom``). Other NATS clients
  read the id back with any URL-unquote function.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote

from .errors import InvalidStreamIdError

__all__ = ["StreamId", "decode_entity_id", "encode_entity_id", "filter_subjects", "validate_category"]

_CATEGORY = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_MAX_ID_LENGTH = 256
# Characters that may stand in a subject token as they are: printable ASCII
# except the subject separator and wildcards, and '%' (our escape character).
_PLAIN = frozenset(chr(c) for c in range(0x21, 0x7F)) - {".", "*", ">", "%"}
# The same rules as regular expressions, so that an id is checked in one scan in C: appends and reads encode ids
# on every call.
_NOT_PLAIN = re.compile(r"[^\x21-\x24\x26-\x29\x2b-\x2d\x2f-\x3d\x3f-\x7e]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def validate_category(category: str) -> str:
    """Return ``category`` if it can name a category, else raise :class:`InvalidStreamIdError`."""
    if not isinstance(category, str) or not _CATEGORY.fullmatch(category):
        raise InvalidStreamIdError(
            f"Invalid category {category!r}: a category must start with a letter and contain only "
            "letters, digits, '_' or '-' (at most 64 characters), e.g. 'Account' or 'ShoppingCart'."
        )
    return category


def encode_entity_id(entity_id: str) -> str:
    """Encode an entity id into one legal NATS subject token (reversible, see module docs)."""
    if not isinstance(entity_id, str) or not entity_id:
        raise InvalidStreamIdError(
            f"Invalid entity id {entity_id!r}: an entity id must be a non-empty string."
        )
    if len(entity_id) > _MAX_ID_LENGTH:
        raise InvalidStreamIdError(
            f"Invalid entity id {entity_id[:40]!r}...: it has {len(entity_id)} characters, "
            f"at most {_MAX_ID_LENGTH} are allowed. Use a shorter key, e.g. a UUID or a hash."
        )
    if _NOT_PLAIN.search(entity_id) is None:
        return entity_id
    if _CONTROL.search(entity_id):
        raise InvalidStreamIdError(
            f"Invalid entity id {entity_id!r}: control characters are not allowed in entity ids."
        )
    if _SURROGATE.search(entity_id):
        # A lone surrogate has no UTF-8 form, so it could not be escaped into the subject.
        raise InvalidStreamIdError(
            f"Invalid entity id {entity_id!r}: it contains a lone surrogate (not a Unicode character); "
            "decode the id properly (e.g. from UTF-8) before using it."
        )
    return "".join(ch if ch in _PLAIN else "".join(f"%{b:02X}" for b in ch.encode()) for ch in entity_id)


def decode_entity_id(token: str) -> str:
    """Turn a subject token written by :func:`encode_entity_id` back into the entity id."""
    return unquote(token) if "%" in token else token


def filter_subjects(prefix: str, categories: Sequence[str] | None) -> list[str]:
    """The subject filters that select ``categories``' events under ``prefix`` (all events when None or empty)."""
    if not categories:
        return [f"{prefix}.>"]
    return [f"{prefix}.{validate_category(c)}.*" for c in categories]


@dataclass(frozen=True, slots=True)
class StreamId:
    """One entity's stream: its category and its id. Validated on construction.

    ``str(StreamId("Account", "42"))`` is ``"Account/42"``; :meth:`parse` reads that back.
    """

    category: str
    entity_id: str
    _token: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate_category(self.category)
        object.__setattr__(self, "_token", encode_entity_id(self.entity_id))

    def subject(self, prefix: str) -> str:
        """The NATS subject holding this entity's events under ``prefix`` (e.g. ``events``)."""
        return f"{prefix}.{self.category}.{self._token}"

    @classmethod
    def from_subject(cls, subject: str, prefix: str) -> "StreamId":
        """Read the stream id back from a subject written by :meth:`subject`."""
        category, _, token = subject[len(prefix) + 1 :].partition(".")
        if not subject.startswith(prefix + ".") or not category or not token:
            raise InvalidStreamIdError(f"Subject {subject!r} is not an event subject under {prefix!r}.")
        # Subjects were validated when written: skip validation on this hot read path.
        stream_id = object.__new__(cls)
        object.__setattr__(stream_id, "category", category)
        object.__setattr__(stream_id, "entity_id", decode_entity_id(token))
        object.__setattr__(stream_id, "_token", token)
        return stream_id

    @classmethod
    def parse(cls, text: str) -> "StreamId":
        """Parse ``"Category/entity-id"`` (the form ``str()`` gives)."""
        if not isinstance(text, str):
            raise InvalidStreamIdError(f"{text!r} is not a stream id; write it as the string 'Category/entity-id'.")
        category, sep, entity_id = text.partition("/")
        if not sep:
            raise InvalidStreamIdError(f"{text!r} is not a stream id; write it as 'Category/entity-id'.")
        return cls(category, entity_id)

    def __str__(self) -> str:
        return f"{self.category}/{self.entity_id}"

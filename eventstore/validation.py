"""Checks of the public API's arguments, made before anything is sent to the server.

A wrong argument must never pass as a default: ``expected_version="1"`` or
``expected_version=None`` silently behaving like ``ANY`` would drop the
concurrency check. So every check is strict about types (``True`` is not a
version, ``2.0`` is not a position) and raises :class:`InvalidArgumentError`
naming the argument, the value given and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel

from .errors import InvalidArgumentError, InvalidEventError
from .events import ANY, NO_STREAM, ExpectedVersion
from .streams import StreamId, validate_category

if TYPE_CHECKING:
    from .commit import EntityAppend

__all__ = [
    "check_bool",
    "check_categories",
    "check_entity_append",
    "check_expected_version",
    "check_int",
    "check_optional_int",
    "check_seconds",
    "check_stream_id",
]


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(name: str, value: object, allowed: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"Invalid {name}: {_shown(value)} ({type(value).__name__}); {allowed}.")


def check_int(name: str, value: object, minimum: int, maximum: int | None = None, *, what: str = "") -> int:
    """``value`` if it is an ``int`` (not a bool) in ``[minimum, maximum]``, else :class:`InvalidArgumentError`.

    ``what`` says what the number means in the error (e.g. ``"a position"``).
    """
    bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
    allowed = f"it must be {what + ', ' if what else ''}an int {bound}"
    # bool is an int subclass: True would pass as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(name, value, allowed)
    if value < minimum or (maximum is not None and value > maximum):
        raise _refuse(name, value, allowed)
    return value


def check_optional_int(name: str, value: object, minimum: int, *, what: str = "") -> int | None:
    """Like :func:`check_int`, but ``None`` is allowed and returned as is."""
    return None if value is None else check_int(name, value, minimum, what=what)


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False`` (not a truthy stand-in), else :class:`InvalidArgumentError`."""
    if not isinstance(value, bool):
        raise _refuse(name, value, "it must be True or False")
    return value


def check_seconds(name: str, value: object, minimum: float, maximum: float) -> float:
    """``value`` as float if it is a finite number of seconds in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _refuse(name, value, f"it must be a number of seconds between {minimum} and {maximum}")
    if not minimum <= value <= maximum:
        raise _refuse(name, value, f"it must be a number of seconds between {minimum} and {maximum}")
    return float(value)


def check_stream_id(name: str, value: object) -> StreamId:
    """``value`` if it is a :class:`StreamId`; a string is refused (write ``StreamId(category, id)``)."""
    if not isinstance(value, StreamId):
        raise _refuse(
            name, value, "it must be a StreamId, e.g. StreamId('Account', '42') or StreamId.parse('Account/42')"
        )
    return value


def check_categories(value: object) -> Sequence[str] | None:
    """``None`` (all categories) or a list of valid category names; a bare string is refused."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise _refuse("categories", value, "it must be None (all) or a list of category names, e.g. ['Account']")
    for category in value:
        validate_category(category)
    return value


def check_expected_version(value: object) -> ExpectedVersion:
    """An exact version (an int >= 0), :data:`NO_STREAM` or :data:`ANY`; anything else is refused."""
    if value is ANY or value is NO_STREAM:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _refuse("expected_version", value, "it must be NO_STREAM, ANY or an exact version (an int >= 0)")
    return value


def check_entity_append(request: "EntityAppend") -> None:
    """Check every field of one entity's append (see :class:`~eventstore.EntityAppend`)."""
    stream_id = check_stream_id("stream_id", request.stream_id)
    expected = check_expected_version(request.expected_version)
    position = check_optional_int("expected_position", request.expected_position, 0, what="a position")
    if position is not None:
        if not isinstance(expected, int):
            raise InvalidArgumentError(
                f"Invalid expected_position {position} for {stream_id}: it needs an exact expected_version "
                f"(the version of the commit at that position), not {expected}."
            )
        if (expected == 0) != (position == 0):
            raise InvalidArgumentError(
                f"Invalid expected_position {position} for {stream_id} at expected_version {expected}: an entity "
                "without events is at position 0, and one with events at a position >= 1."
            )
    events = request.events
    if isinstance(events, (str, bytes, bytearray, Mapping, BaseModel)) or not isinstance(events, Sequence):
        raise _refuse(f"events for {stream_id}", events, "they must be a list of event model instances")
    if not events:
        raise InvalidEventError(f"Nothing to append to {stream_id}: the list of events is empty.")
    for event in events:
        if not isinstance(event, BaseModel):
            raise InvalidEventError(
                f"Cannot append {_shown(event)} to {stream_id}: events must be instances of registered pydantic models."
            )


MAX_BATCH = 100_000
"""The most events a read hands over at once."""


def check_read(stream_id: object, from_version: object, to_version: object, from_position: object,
               consistent: object) -> None:
    """The arguments of ``read`` (one entity's events), as every event store checks them."""
    check_stream_id("stream_id", stream_id)
    check_int("from_version", from_version, 1, what="a version")
    check_optional_int("to_version", to_version, from_version, what="a version")  # type: ignore[arg-type]
    check_int("from_position", from_position, 0, what="a position")
    check_bool("consistent", consistent)


def check_read_all(from_position: object, to_position: object, categories: object, batch: object) -> None:
    """The arguments of ``read_all`` (every event in global order), as every event store checks them."""
    check_int("from_position", from_position, 1, what="a position")
    check_optional_int("to_position", to_position, 0, what="a position")
    check_categories(categories)
    check_int("batch", batch, 1, MAX_BATCH)


def check_remember(stream_id: object, version: object, position: object) -> None:
    """The arguments of ``remember``: an entity's (version, position), both 0 or both >= 1."""
    check_stream_id("stream_id", stream_id)
    if (check_int("version", version, 0) == 0) != (check_int("position", position, 0) == 0):
        raise InvalidArgumentError(
            f"Invalid (version, position) ({version}, {position}) for {stream_id}: both are 0 for an entity "
            "without events, both >= 1 for one with events."
        )


def check_find_append(stream_id: object, idempotency_key: object, from_position: object = 1) -> None:
    """The arguments of ``find_append``."""
    check_stream_id("stream_id", stream_id)
    check_int("from_position", from_position, 1)
    if not isinstance(idempotency_key, str) or not idempotency_key:
        raise InvalidArgumentError(
            f"Invalid idempotency_key: {idempotency_key!r:.80}; it must be a non-empty string."
        )

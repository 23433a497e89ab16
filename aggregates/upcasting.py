"""Upcasters: plain functions that bring a stored event's JSON from schema version n to n+1.

Example::

    class Deposited(DomainEvent, version=3):
        amount_cents: int
        currency: str

    @upcaster(Deposited, from_version=1)
    def _add_currency(data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "currency": "EUR"}

    @upcaster(Deposited, from_version=2)
    def _to_cents(data: dict[str, Any]) -> dict[str, Any]:
        return {"amount_cents": data["amount"] * 100, "currency": data["currency"]}

Reading applies the chain 1 -> 2 -> 3, so domain code only ever sees the
newest model. Stored events are never rewritten.
"""

from __future__ import annotations

from collections.abc import Callable

from eventstore import Upcaster

from .errors import AggregateDefinitionError
from .events import DomainEvent

__all__ = ["upcaster"]


def upcaster(event: type[DomainEvent], *, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Attach the decorated function as ``event``'s upcaster from ``from_version`` to ``from_version + 1``.

    The function receives the stored JSON object (a dict) and returns the next
    version's. It is registered with the event wherever the event is
    registered (repositories, :func:`register_events`), so define it next to
    the event, before repositories are created. The decorated function is
    returned unchanged.
    """

    def attach(function: Upcaster) -> Upcaster:
        current = event.__schema_version__
        if not 1 <= from_version < current:
            raise AggregateDefinitionError(
                f"Upcaster {function.__qualname__} reads {event.__qualname__} version {from_version}, but "
                f"{event.__qualname__} is at version {current}: upcasters exist for versions 1 to {current - 1}."
            )
        existing = event.__upcasters__.get(from_version)
        if existing is not None and existing is not function:
            raise AggregateDefinitionError(
                f"{event.__qualname__} already has an upcaster from version {from_version} "
                f"({existing.__qualname__}); keep one function per step."
            )
        event.__upcasters__[from_version] = function
        return function

    return attach

"""Domain events: immutable pydantic models with a stable type name and a schema version.

Example::

    class Deposited(DomainEvent, type_name="Deposited", version=2):
        amount: int
        currency: str

The type name (default: the class name) and the schema version (default: 1)
are what the event store writes next to each payload; renaming the class
later is safe as long as ``type_name`` keeps the old name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from eventstore import TypeRegistry, Upcaster

from .errors import AggregateDefinitionError

__all__ = ["DomainEvent", "register_events"]


class DomainEvent(BaseModel):
    """Base class of domain events: frozen pydantic models, registered by their stable type name.

    Guarantees: an instance cannot be changed after construction; a field
    the class does not declare (a misspelt name, say) is refused with
    pydantic's ``ValidationError`` when the event is constructed, while a
    stored event with fields its class no longer declares still reads (they
    are left out); every subclass has ``__event_type__`` (the stored type
    name) and ``__schema_version__``, which :class:`eventstore.TypeRegistry` reads.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    __event_type__: ClassVar[str] = "DomainEvent"
    __schema_version__: ClassVar[int] = 1
    # Upcasters keyed by the schema version they read; filled by @upcaster.
    __upcasters__: ClassVar[dict[int, Upcaster]] = {}

    def __init_subclass__(cls, *, type_name: str | None = None, version: int = 1, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise AggregateDefinitionError(f"{cls.__qualname__}: version must be an int >= 1, not {version!r}.")
        # Set on every subclass: a subclass is a new event type, it does not inherit its parent's name.
        cls.__event_type__ = type_name or cls.__name__
        cls.__schema_version__ = version
        cls.__upcasters__ = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if not cls.model_config.get("frozen"):
            raise AggregateDefinitionError(
                f"{cls.__qualname__} sets frozen=False: domain events are facts and must stay immutable."
            )
        # Fail at import, not at the first append, on a name the event store would refuse.
        try:
            TypeRegistry().register(cls)
        except Exception as exc:
            raise AggregateDefinitionError(f"{cls.__qualname__}: {exc}") from exc


def register_events(registry: TypeRegistry, events: Iterable[type[DomainEvent]]) -> None:
    """Register event classes and their upcasters into ``registry``; registering again is a no-op.

    Repositories call this for their aggregate's events; call it yourself where
    events are read without a repository (projections).
    """
    for event in events:
        registry.register(event)
        for from_version, function in sorted(event.__upcasters__.items()):
            registry.register_upcaster(event.__event_type__, from_version, function)

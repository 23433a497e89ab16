"""Defining a projection: a named class with one handler per event type, writing to declared tables.

Example::

    from projections import Projection, Table, Transaction, handles
    from eventstore import RecordedEvent

    class AccountBalances(Projection):
        name = "account_balances"          # names the read model: never change it
        version = 1                        # bump it when handlers or tables change: the model is rebuilt
        categories = ("Account",)          # None: every category
        tables = (Table("balances", key="account_id", columns={"account_id": str, "balance": int}),)

        @handles(Deposited)                # an event class (registered on bind) or a type name
        def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
            data = event.data
            assert isinstance(data, Deposited)
            row = tx.get("balances", event.stream_id.entity_id) or {"balance": 0}
            tx.upsert("balances", event.stream_id.entity_id, {"balance": row["balance"] + data.amount})

Handlers must be deterministic functions of the events they see and the rows
they read (no clock, no randomness, no I/O outside ``tx``): a rebuild, a
restart after a crash and a Spark fold must all give the same rows. To stay
foldable per entity in Spark, a handler should only touch rows that belong to
the event's own entity (keys derived from ``event.stream_id`` or the event).

Events of types without a handler are skipped by their type name alone: their
payload is never decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel

from eventstore import RecordedEvent, TypeRegistry, UnknownEventTypeError
from eventstore.streams import validate_category

from .errors import ProjectionDefinitionError
from .tables import Table, check_name
from .transaction import Transaction

__all__ = ["ErrorPolicy", "Handler", "Projection", "check_distinct_tables", "event_type_name", "handles"]

Handler = Callable[[RecordedEvent, Transaction], None]
"""A bound handler: applies one event to the read model through ``tx``."""

F = TypeVar("F", bound=Callable[..., Any])

_HANDLES = "__jetsourcing_handles__"


class ErrorPolicy(str, Enum):
    """What the daemon does when a handler raises. Never "skip silently"."""

    STOP = "stop"
    """Stop this projection with a full report (position, type, stream id, traceback); others keep running."""
    DEAD_LETTER = "dead_letter"
    """Record the failing commit in the dead-letter table (in the same transaction as the checkpoint) and go on."""


def event_type_name(event_class: type[BaseModel], registry: TypeRegistry | None = None) -> str:
    """The stored type name of ``event_class``: the registry's, or else the registry's default rule."""
    if registry is not None:
        return registry.name_of(event_class)[0]
    return str(getattr(event_class, "__event_type__", None) or event_class.__name__)


def handles(*event_types: str | type[BaseModel]) -> Callable[[F], F]:
    """Mark a method ``(self, event, tx) -> None`` as the handler of ``event_types`` (type names or event classes)."""
    if not event_types:
        raise ProjectionDefinitionError("@handles() needs at least one event type (a type name or an event class).")
    for t in event_types:
        if not isinstance(t, str) and not (isinstance(t, type) and issubclass(t, BaseModel)):
            raise ProjectionDefinitionError(f"@handles({t!r}): give a type name or a pydantic event class.")

    def mark(method: F) -> F:
        setattr(method, _HANDLES, tuple(getattr(method, _HANDLES, ())) + tuple(event_types))
        return method

    return mark


class Projection:
    """Base class of projections. Subclasses set the class attributes below and mark handlers with :func:`handles`.

    Guarantees: the definition is checked when the class is created (names,
    tables, duplicate handlers) and when bound to a registry (type names);
    :meth:`apply` calls exactly the handler registered for ``event.type`` and
    never touches ``event.data`` itself.
    """

    name: ClassVar[str]
    """Names the read model (checkpoint, lease, status). Letters, digits, '_'; never change it."""
    version: ClassVar[int] = 1
    """Bump it whenever handlers or tables change in a way that changes results: the read model is rebuilt."""
    categories: ClassVar[tuple[str, ...] | None] = None
    """The categories to read; None reads every category."""
    tables: ClassVar[tuple[Table, ...]] = ()
    """The tables the handlers write."""
    error_policy: ClassVar[ErrorPolicy] = ErrorPolicy.STOP
    """What to do when a handler raises (the daemon's settings may override it)."""

    _handles: ClassVar[dict[str | type[BaseModel], str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found: dict[str | type[BaseModel], str] = {}
        for klass in reversed(cls.__mro__):
            own: dict[str | type[BaseModel], str] = {}
            for attr, value in vars(klass).items():
                for event_type in getattr(value, _HANDLES, ()):
                    if event_type in own and own[event_type] != attr:
                        raise ProjectionDefinitionError(
                            f"{klass.__qualname__} handles {_label(event_type)} twice: in {own[event_type]}() and "
                            f"{attr}(). Keep one handler per event type."
                        )
                    own[event_type] = attr
            found.update(own)  # a subclass's handler replaces its base's for the same type
        cls._handles = found
        if "name" in vars(cls) or hasattr(cls, "name"):
            cls._check_definition()

    @classmethod
    def _check_definition(cls) -> None:
        if not isinstance(getattr(cls, "name", None), str):
            raise ProjectionDefinitionError(
                f"{cls.__qualname__} has no name: set `name = \"...\"` (it names the read model and must never change)."
            )
        check_name("projection", cls.name)
        if type(cls.version) is not int or cls.version < 1:
            raise ProjectionDefinitionError(f"{cls.__qualname__}.version must be an int >= 1, not {cls.version!r}.")
        if cls.categories is not None:
            if isinstance(cls.categories, str) or not cls.categories:
                raise ProjectionDefinitionError(
                    f"{cls.__qualname__}.categories must be a non-empty tuple of category names, or None for all."
                )
            cls.categories = tuple(validate_category(c) for c in cls.categories)
        cls.tables = tuple(cls.tables)
        seen: dict[str, str] = {}
        for table in cls.tables:
            if not isinstance(table, Table):
                raise ProjectionDefinitionError(f"{cls.__qualname__}.tables must hold Table objects, not {table!r}.")
            other = seen.get(table.name.lower())
            if other == table.name:
                raise ProjectionDefinitionError(f"{cls.__qualname__} declares table {table.name!r} twice.")
            if other is not None:
                raise ProjectionDefinitionError(
                    f"{cls.__qualname__} declares tables {other!r} and {table.name!r}, which differ only in case: "
                    "SQLite would store them as one table. Rename one of them."
                )
            seen[table.name.lower()] = table.name
        if not isinstance(cls.error_policy, ErrorPolicy):
            cls.error_policy = ErrorPolicy(cls.error_policy)

    def __init__(self) -> None:
        type(self)._check_definition()
        self._handlers: dict[str, Handler] = {}
        self.bind(None)

    # -- binding ------------------------------------------------------------

    def register_events(self, registry: TypeRegistry) -> None:
        """Register the event classes the handlers name, so ``event.data`` decodes them.

        Override to register more models or upcasters (call ``super()``).
        """
        for event_type in self._handles:
            if not isinstance(event_type, str):
                try:
                    registry.name_of(event_type)  # already registered, maybe under a custom name: keep it
                except UnknownEventTypeError:
                    registry.register(event_type)

    def bind(self, registry: TypeRegistry | None) -> None:
        """Resolve handlers to stored type names (registering event classes in ``registry``).

        Without a registry, class-keyed handlers use the registry's default
        name rule (``__event_type__`` or the class name).
        """
        if registry is not None:
            self.register_events(registry)
        handlers: dict[str, Handler] = {}
        sources: dict[str, str] = {}
        for event_type, attr in self._handles.items():
            type_name = event_type if isinstance(event_type, str) else event_type_name(event_type, registry)
            if type_name in handlers and sources[type_name] != attr:
                raise ProjectionDefinitionError(
                    f"{type(self).__qualname__} handles event type {type_name!r} in both {sources[type_name]}() and "
                    f"{attr}() (once by name, once by class?). Keep one handler per event type."
                )
            handlers[type_name] = getattr(self, attr)
            sources[type_name] = attr
        self._handlers = handlers

    # -- applying -----------------------------------------------------------

    @property
    def handled_types(self) -> frozenset[str]:
        """The stored type names this projection handles; every other event is skipped undecoded."""
        return frozenset(self._handlers)

    def handler_for(self, type_name: str) -> Handler | None:
        """The bound handler for a stored type name, or None when events of that type are skipped."""
        return self._handlers.get(type_name)

    @property
    def handlers(self) -> Mapping[str, Handler]:
        """Stored type name -> bound handler."""
        return self._handlers

    def apply(self, event: RecordedEvent, tx: Transaction) -> bool:
        """Apply one event through its handler; returns False (and does nothing) for unhandled types."""
        handler = self._handlers.get(event.type)
        if handler is None:
            return False
        handler(event, tx)
        return True

    def table(self, name: str) -> Table:
        """The declared table ``name``."""
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"{type(self).__qualname__} declares no table {name!r}.")

    def describe(self) -> dict[str, Any]:
        """The definition as JSON-able data: stored with the read model to detect changes without a version bump."""
        return {
            "name": self.name,
            "version": self.version,
            "categories": list(self.categories) if self.categories is not None else None,
            "tables": [t.spec() for t in self.tables],
        }

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} {self.name!r} v{self.version}>"


def check_distinct_tables(projections: Iterable[Projection]) -> None:
    """Refuse projections that declare the same table, or tables whose names differ only in case (SQLite
    would store them as one table, so both stores refuse them): before any of them creates anything."""
    owners: dict[str, tuple[str, str]] = {}
    for projection in projections:
        for table in projection.tables:
            found = owners.get(table.name.lower())
            if found is not None and found[0] != projection.name:
                other, other_table = found
                how = "the same table" if other_table == table.name else "tables that differ only in case"
                raise ProjectionDefinitionError(
                    f"Projections {other!r} and {projection.name!r} declare {how} ({other_table!r} and "
                    f"{table.name!r}); SQLite would store them as one table. Rename one of them."
                )
            owners[table.name.lower()] = (projection.name, table.name)


def _label(event_type: str | type[BaseModel]) -> str:
    return repr(event_type) if isinstance(event_type, str) else event_type.__qualname__

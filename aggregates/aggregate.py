"""Aggregates: command methods that check invariants and record events, handlers that apply them to state.

Example::

    class AccountState(BaseModel):
        owner: str = ""
        balance: int = 0

    class Account(Aggregate[AccountState]):          # category "Account"
        def deposit(self, amount: int) -> None:      # a command: checks, then records
            if amount <= 0:
                raise DomainError("Deposit a positive amount.")
            self.record(Deposited(amount=amount))

        @applies(Deposited)                          # how the event changes state
        def _deposited(self, event: Deposited) -> None:
            self.state.balance += event.amount

All of an aggregate's data lives in ``state``, a pydantic model whose fields
all have defaults. Only handlers change it: loading replays stored events
through the handlers alone, so commands (and their invariant checks) never run
during a replay, and snapshots can store ``state`` as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Generic, TypeVar, cast, get_args, get_origin

from pydantic import BaseModel, ValidationError

from eventstore import InvalidStreamIdError, RecordedEvent, StreamId, UnknownEventTypeError
from eventstore.streams import validate_category

from .errors import (
    AggregateDefinitionError,
    InvalidAggregateIdError,
    InvalidStoredEventError,
    MissingHandlerError,
    UnregisteredEventError,
)
from .events import DomainEvent

__all__ = ["Aggregate", "applies"]

S = TypeVar("S", bound=BaseModel)
E = TypeVar("E", bound=DomainEvent)
A = TypeVar("A", bound="Aggregate[Any]")

Handler = Callable[[Any, Any], None]


def applies(event: type[E]) -> Callable[[Callable[[A, E], None]], Callable[[A, E], None]]:
    """Mark an aggregate method as the handler that applies ``event`` to the aggregate's state.

    The handler runs when the event is recorded and whenever it is replayed; it
    must only change ``self.state``, never check invariants or raise for
    business reasons (the event already happened). Each event type has exactly
    one handler per aggregate class; a subclass may override its parent's.
    """
    if not (isinstance(event, type) and issubclass(event, DomainEvent)):
        raise AggregateDefinitionError(f"@applies needs a DomainEvent subclass, not {event!r}.")

    def mark(handler: Callable[[A, E], None]) -> Callable[[A, E], None]:
        handler.__applies__ = event  # type: ignore[attr-defined]
        return handler

    return mark


def _state_type(cls: type) -> type[BaseModel] | None:
    """The concrete state model named in ``class X(Aggregate[State])``, if this class names one."""
    for base in cls.__dict__.get("__orig_bases__", ()):
        origin = get_origin(base)
        if isinstance(origin, type) and issubclass(origin, Aggregate):
            for arg in get_args(base):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    return arg
    return None


class Aggregate(Generic[S]):
    """A consistency boundary: an id, a version, a state, and the events recorded since it was loaded.

    Guarantees:

    * ``id`` is valid for a stream id (checked on construction, raising
      :class:`InvalidAggregateIdError`); ``stream_id`` is the event store
      stream that holds the events, ``<category>/<id>``.
    * ``version`` is the number of events applied (stored and pending);
      ``position`` is the stream position of the last *stored* event applied
      (0 for an aggregate never saved).
    * :meth:`record` applies the event at once and queues it in ``pending``;
      a repository's ``save`` stores the pending events atomically or not at all.
    * Replaying stored events runs only ``@applies`` handlers.
    * ``commands`` maps the idempotency key (command id) of every stored
      commit applied to it to that commit's (last version, position), however
      old: a repository runs a command id at most once per aggregate.

    Class keywords: ``category`` (default: the class name) names the stream
    category, e.g. ``class Account(Aggregate[AccountState], category="Accounts")``.
    """

    category: ClassVar[str] = "Aggregate"
    state_type: ClassVar[type[BaseModel]]
    _handlers: ClassVar[dict[type[BaseModel], Handler]] = {}

    def __init_subclass__(cls, *, category: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        try:
            cls.category = validate_category(category or cls.__name__)
        except InvalidStreamIdError as exc:
            raise AggregateDefinitionError(f"{cls.__qualname__}: {exc}") from exc
        state = _state_type(cls)
        if state is not None:
            try:
                state()
            except ValidationError as exc:
                raise AggregateDefinitionError(
                    f"{cls.__qualname__}: its state {state.__qualname__} must be constructible without arguments "
                    f"(a new aggregate starts from it); give every field a default. {exc}"
                ) from exc
            cls.state_type = state
        own: dict[type[BaseModel], Handler] = {}
        for name, attr in vars(cls).items():
            event = getattr(attr, "__applies__", None)
            if event is None:
                continue
            if event in own:
                raise AggregateDefinitionError(
                    f"{cls.__qualname__} has two handlers for {event.__qualname__}: "
                    f"{own[event].__name__} and {name}. Keep one."
                )
            own[event] = attr
        cls._handlers = {**cls._handlers, **own}

    def __init__(self, id: str) -> None:
        """A new aggregate at version 0, with the default state; nothing is stored until it is saved."""
        if not hasattr(type(self), "state_type"):
            raise AggregateDefinitionError(
                f"{type(self).__qualname__} names no state model: declare it as "
                f"class {type(self).__name__}(Aggregate[YourState])."
            )
        self.id = id
        self.stream_id = self._stream_id(id)
        self.version = 0
        self.position = 0
        self.state: S = cast(S, self.state_type())
        self._pending: list[DomainEvent] = []
        self.commands: dict[str, tuple[int, int]] = {}
        self._historic = False  # loaded with get(version=...): possibly not at a commit's end

    @classmethod
    def _stream_id(cls, aggregate_id: str) -> StreamId:
        try:
            return StreamId(cls.category, aggregate_id)
        except InvalidStreamIdError as exc:
            raise InvalidAggregateIdError(f"Invalid {cls.__name__} id: {exc}") from exc

    @classmethod
    def event_types(cls) -> tuple[type[DomainEvent], ...]:
        """Every event type this aggregate has a handler for (the ones a repository registers)."""
        return tuple(t for t in cls._handlers if issubclass(t, DomainEvent))

    @property
    def pending(self) -> tuple[DomainEvent, ...]:
        """Events recorded since the last load or save, in order; they are already applied to ``state``."""
        return tuple(self._pending)

    def record(self, event: DomainEvent) -> None:
        """Apply ``event`` to the state now and queue it for the next save.

        Raises :class:`MissingHandlerError` (nothing recorded) when the aggregate
        has no handler for the event's type.
        """
        handler = self._handlers.get(type(event))
        if handler is None:
            raise MissingHandlerError(type(self).__name__, self.id, _type_name(event))
        handler(self, event)
        self.version += 1
        self._pending.append(event)

    # -- used by repositories -------------------------------------------------

    def _replay(self, recorded: Iterable[RecordedEvent]) -> None:
        """Apply stored events through their handlers only, moving version and position along."""
        handlers = self._handlers
        for stored in recorded:
            try:
                event = stored.data
            except UnknownEventTypeError as exc:
                raise UnregisteredEventError(type(self).__name__, self.id, stored.type, stored.position, str(exc)) from exc
            except Exception as exc:
                raise InvalidStoredEventError(type(self).__name__, self.id, stored.type, stored.position, str(exc)) from exc
            handler = handlers.get(type(event))
            if handler is None:
                raise MissingHandlerError(type(self).__name__, self.id, stored.type, stored.position)
            try:
                handler(self, event)
            except Exception as exc:
                exc.add_note(f"while replaying {self!r} at the {stored.type!r} event at position {stored.position}")
                raise
            self.version = stored.version
            self.position = stored.position
            if stored.idempotency_key is not None:
                self.commands[stored.idempotency_key] = (stored.version, stored.position)

    def _committed(self, version: int, position: int, command_id: str | None = None) -> None:
        """The pending events are stored, the last of them at ``version`` in the commit at ``position``."""
        self._pending.clear()
        self.version = version
        self.position = position
        self._historic = False
        if command_id is not None:
            self.commands[command_id] = (version, position)

    def _copy(self: A) -> A:
        """An independent copy without pending events (for caches: the state is deep-copied)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.state = self.state.model_copy(deep=True)
        twin._pending = []
        twin.commands = dict(self.commands)
        return twin

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id!r} v{self.version}>"


def _type_name(event: object) -> str:
    return str(getattr(type(event), "__event_type__", type(event).__qualname__))

"""The type registry: stable event type names <-> pydantic models, with upcasters between schema versions.

A stored event carries its type name and the schema version it was written
with. Reading looks the name up here; an older schema version is brought up to
date by the registered upcasters (plain functions over the stored JSON, one
step n -> n+1 each) before the newest model validates it. Stored events are
never rewritten.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from .errors import EventDecodeError, InvalidEventError, UnknownEventTypeError

if TYPE_CHECKING:
    from .streams import StreamId

__all__ = ["TypeRegistry", "Upcaster"]

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
"""Turns the JSON object of schema version n into the JSON object of version n+1."""

M = TypeVar("M", bound=type[BaseModel])

# No commas: a commit of several events lists their type names comma-separated in one header.
_TYPE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,127}")


class TypeRegistry:
    """Maps stable type names to pydantic models and back, and upcasts old payloads.

    A model's type name defaults to ``model.__event_type__`` or else its class
    name; its schema version to ``model.__schema_version__`` or else 1. A name
    maps to exactly one model and one current version.
    """

    def __init__(self) -> None:
        self._models: dict[str, tuple[type[BaseModel], int]] = {}
        self._names: dict[type[BaseModel], tuple[str, int]] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}

    def register(self, model: M, *, name: str | None = None, version: int | None = None) -> M:
        """Register ``model`` (usable as a class decorator).

        Registering a model again is a no-op when no name or version is given,
        or when they equal the registered ones; a different name or version for
        an already registered model is refused (one model, one stored name).
        """
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise InvalidEventError(f"{model!r} is not a pydantic model; event types must subclass pydantic.BaseModel.")
        registered = self._names.get(model)
        if registered is not None:
            if (name or registered[0], version or registered[1]) != registered:
                raise InvalidEventError(
                    f"{model.__qualname__} is already registered as {registered[0]!r} version {registered[1]}; "
                    f"it cannot also be {name or registered[0]!r} version {version or registered[1]}."
                )
            return model
        type_name = name or getattr(model, "__event_type__", None) or model.__name__
        schema_version = version or getattr(model, "__schema_version__", None) or 1
        if not _TYPE_NAME.fullmatch(type_name):
            raise InvalidEventError(
                f"Invalid event type name {type_name!r} for {model.__qualname__}: use letters, digits and "
                "'_', '.', ':', '-' only (no commas or spaces), starting with a letter or '_'."
            )
        if not isinstance(schema_version, int) or schema_version < 1:
            raise InvalidEventError(f"Schema version of {type_name!r} must be an int >= 1, not {schema_version!r}.")
        existing = self._models.get(type_name)
        if existing is not None and existing[0] is not model:
            raise InvalidEventError(
                f"Event type name {type_name!r} is already registered for {existing[0].__qualname__}; "
                f"give {model.__qualname__} another name (each stored type name must mean one model)."
            )
        self._models[type_name] = (model, schema_version)
        self._names[model] = (type_name, schema_version)
        return model

    def register_upcaster(self, type_name: str, from_version: int, upcaster: Upcaster) -> None:
        """Register the function that turns ``type_name``'s JSON of ``from_version`` into ``from_version + 1``."""
        key = (type_name, from_version)
        if key in self._upcasters and self._upcasters[key] is not upcaster:
            raise InvalidEventError(f"An upcaster from version {from_version} of {type_name!r} is already registered.")
        self._upcasters[key] = upcaster

    def name_of(self, model: type[BaseModel]) -> tuple[str, int]:
        """The (type name, current schema version) of a registered model."""
        try:
            return self._names[model]
        except KeyError:
            raise UnknownEventTypeError(
                f"Event class {model.__qualname__} is not registered; register it with "
                "TypeRegistry.register (aggregates' DomainEvent subclasses register themselves)."
            ) from None

    def encode(self, event: BaseModel, stream_id: "StreamId | None" = None) -> tuple[str, int, bytes]:
        """The (type name, schema version, JSON payload) to store for a registered model instance.

        Guarantees that the payload decodes back into an event equal to
        ``event``: what cannot be read back is refused here, with
        :class:`InvalidEventError` naming the entity (``stream_id``), the type
        and the field, instead of being stored and failing every later load.
        That covers NaN and infinite floats (JSON has no such numbers; they
        would be written as ``null``), ``bytes`` that are not UTF-8, strings
        with lone surrogates, and any field whose serialisation loses
        information (an excluded field, a lossy custom serializer).
        """
        name, version = self.name_of(type(event))
        where = f" to {stream_id}" if stream_id is not None else ""
        try:
            payload = event.model_dump_json().encode()
        except (PydanticSerializationError, UnicodeEncodeError) as exc:
            raise InvalidEventError(
                f"Cannot append {name}{where}: it cannot be written as JSON ({exc}). Nothing was stored."
            ) from None
        try:
            back = type(event).model_validate_json(payload)
        except ValidationError as exc:
            fields = ", ".join(".".join(map(str, e["loc"])) or "the event" for e in exc.errors())
            raise InvalidEventError(
                f"Cannot append {name}{where}: field {fields} would be stored as JSON that does not validate "
                f"back into {type(event).__qualname__} (NaN and infinite floats, for example, become null). "
                "Nothing was stored."
            ) from None
        if back != event:
            lost = [f for f in type(event).model_fields if getattr(back, f, None) != getattr(event, f, None)]
            raise InvalidEventError(
                f"Cannot append {name}{where}: field {', '.join(lost) or '(private or extra attributes)'} would "
                "read back with a different value (NaN, for example, never equals itself; excluded fields and "
                "lossy serializers drop data). Nothing was stored."
            )
        return name, version, payload

    def model_for(self, type_name: str) -> tuple[type[BaseModel], int]:
        """The (model, current schema version) registered under ``type_name``."""
        try:
            return self._models[type_name]
        except KeyError:
            known = ", ".join(sorted(self._models)) or "none"
            raise UnknownEventTypeError(
                f"Unknown event type {type_name!r}: no model is registered under that name "
                f"(registered: {known}). Import the module that defines it, or register it."
            ) from None

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._models

    def types(self) -> dict[str, tuple[type[BaseModel], int]]:
        """A copy of every registered type name with its model and current schema version."""
        return dict(self._models)

    def upcast(self, type_name: str, schema_version: int, obj: dict[str, Any]) -> dict[str, Any]:
        """Bring a JSON object of ``schema_version`` up to the current version of ``type_name``."""
        _, current = self.model_for(type_name)
        if schema_version > current:
            raise UnknownEventTypeError(
                f"Event type {type_name!r} was stored with schema version {schema_version}, newer than the "
                f"registered version {current}. Upgrade this program to the code that wrote it."
            )
        for version in range(schema_version, current):
            step = self._upcasters.get((type_name, version))
            if step is None:
                raise EventDecodeError(
                    f"Cannot read {type_name!r} version {schema_version} as version {current}: no upcaster from "
                    f"version {version} to {version + 1} is registered."
                )
            obj = step(obj)
        return obj

    def decode(self, type_name: str, schema_version: int, payload: bytes | str) -> BaseModel:
        """Validate a stored payload into the current model, upcasting older schema versions first.

        Fields the model does not know are left out, even where the model
        forbids them (``extra="forbid"``, as domain events do): that rule is
        for constructing events in code, and a stored event stays readable
        after a field was removed from its model.
        """
        model, current = self.model_for(type_name)
        try:
            if schema_version == current:
                try:
                    return model.model_validate_json(payload)
                except ValidationError as exc:
                    return _without_extra_fields(model, lambda: json.loads(payload), exc)
            obj = self.upcast(type_name, schema_version, json.loads(payload))
            try:
                return model.model_validate(obj)
            except ValidationError as exc:
                return _without_extra_fields(model, lambda: obj, exc)
        except ValidationError as exc:
            raise EventDecodeError(
                f"Stored {type_name!r} (schema version {schema_version}) does not validate against "
                f"{model.__qualname__}: {exc}"
            ) from exc


def _without_extra_fields(model: type[BaseModel], load: Callable[[], Any], refused: ValidationError) -> BaseModel:
    """The object ``load`` gives, validated once more without the fields that ``refused`` named as extra;
    ``refused`` again if it named anything else (invalid JSON, say, which is then never parsed)."""
    errors = refused.errors()
    if not errors or any(e["type"] != "extra_forbidden" or not e["loc"] for e in errors):
        raise refused
    obj = load()
    for error in errors:
        *path, key = error["loc"]
        parent = obj
        for step in path:
            parent = parent[step]
        del parent[key]
    return model.model_validate(obj)

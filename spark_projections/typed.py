"""Typed events in Spark: payload JSON parsed into real columns, old schema versions upcast.

Example::

    from spark_projections.source import read_events
    from spark_projections.typed import typed_events

    events = read_events(spark, settings, categories=["Account"])
    deposits = typed_events(events, registry, Deposited)      # position, ..., amount, currency
    deposits.groupBy("entity_id").sum("amount")

* :func:`spark_schema` derives a Spark ``StructType`` from an event model's
  pydantic JSON schema (serialization mode: the shape the event store wrote).
* :func:`typed_events` keeps the rows of one event type and parses their
  payload with ``from_json`` (``FAILFAST``: a payload that does not fit its
  schema fails the job instead of turning into nulls). Rows stored with an
  older schema version are first brought to the current one by the
  registry's upcasters - plain Python functions, so they run in a
  ``mapInArrow`` task - and re-serialised through the current model, exactly
  as :meth:`eventstore.TypeRegistry.decode` reads them. Current rows pass
  through that task untouched (no per-row Python), and types without
  upcasters skip it entirely.

Type mapping (JSON schema -> Spark): ``str`` -> string; ``int`` -> bigint;
``float`` -> double; ``bool`` -> boolean; ``datetime`` -> timestamp (naive
values are read in the session time zone: store aware UTC datetimes);
``date`` -> date; ``Decimal`` -> decimal(max_digits, decimal_places), default
decimal(38, 18); ``list[T]`` / ``tuple[T, ...]`` / ``set[T]`` -> array;
nested models -> struct; ``dict[str, T]`` -> map; ``Optional[T]`` -> T
(every Spark column here is nullable); enums and literals -> their values'
type; anything else (unions of several types, ``Any``, fixed tuples,
recursive models) -> string holding the value's raw JSON.

Executors must be able to import the event models and upcasters (an
installed package, or ``spark.addPyFile``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from eventstore import TypeRegistry
from spark_projections.errors import SparkProjectionError

__all__ = [
    "DATA_COLUMN",
    "TypedDecodingError",
    "spark_schema",
    "typed_events",
    "typed_frames",
]

DATA_COLUMN = "data"
"""Name of the struct column holding the parsed payload when ``flatten=False``."""

_DEFAULT_DECIMAL = (38, 18)
_MAX_DECIMAL_PRECISION = 38


class TypedDecodingError(SparkProjectionError):
    """An event model cannot be given a Spark schema, or its columns clash with the event columns."""


class _SparkJsonSchema(GenerateJsonSchema):
    """Pydantic's JSON schema, with decimals marked as such (plain JSON schema makes them strings)."""

    def decimal_schema(self, schema: core_schema.DecimalSchema) -> JsonSchemaValue:
        out: JsonSchemaValue = {"type": "string", "format": "decimal"}
        if schema.get("max_digits") is not None:
            out["maxDigits"] = schema["max_digits"]
        if schema.get("decimal_places") is not None:
            out["decimalPlaces"] = schema["decimal_places"]
        return out


def spark_schema(model: type[BaseModel]) -> StructType:
    """The Spark schema of ``model``'s stored JSON (see the module docs for the type mapping).

    Field names are those in the stored JSON: aliases only when the model
    serialises by alias (``serialize_by_alias``), as ``model_dump_json()`` does.
    """
    by_alias = bool(model.model_config.get("serialize_by_alias", False))
    json_schema = model.model_json_schema(by_alias=by_alias, mode="serialization", schema_generator=_SparkJsonSchema)
    result = _convert(json_schema, json_schema.get("$defs", {}), ())
    if not isinstance(result, StructType):
        raise TypedDecodingError(f"{model.__qualname__} does not serialise to a JSON object; it cannot be a table row.")
    return result


def _convert(node: Mapping[str, Any], defs: Mapping[str, Any], expanding: tuple[str, ...]) -> DataType:
    """The Spark type of one JSON schema node; ``expanding`` holds the $refs being expanded (recursion guard)."""
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        if name in expanding or name not in defs:
            return StringType()  # a recursive model: keep its raw JSON
        return _convert(defs[name], defs, (*expanding, name))
    for key in ("anyOf", "oneOf"):
        if key in node:
            options = [o for o in node[key] if o.get("type") != "null"]
            if len(options) == 1:
                return _convert(options[0], defs, expanding)
            return StringType()  # a union of several types: raw JSON
    if "allOf" in node and len(node["allOf"]) == 1:
        return _convert(node["allOf"][0], defs, expanding)
    kind = node.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None:
        values = node.get("enum", [node["const"]] if "const" in node else None)
        if values:
            kind = _json_kind(values)
    if kind == "string":
        return _string_type(node)
    if kind == "integer":
        return LongType()
    if kind == "number":
        return DoubleType()
    if kind == "boolean":
        return BooleanType()
    if kind == "array":
        items = node.get("items")
        if isinstance(items, Mapping) and "prefixItems" not in node:
            return ArrayType(_convert(items, defs, expanding), containsNull=True)
        return StringType()  # a fixed-length tuple: raw JSON
    if kind == "object":
        properties = node.get("properties")
        if properties:
            return StructType(
                [StructField(name, _convert(prop, defs, expanding), nullable=True) for name, prop in properties.items()]
            )
        extra = node.get("additionalProperties")
        value = _convert(extra, defs, expanding) if isinstance(extra, Mapping) and extra else StringType()
        return MapType(StringType(), value, valueContainsNull=True)
    return StringType()  # Any, null, or something JSON schema cannot pin down: raw JSON


def _string_type(node: Mapping[str, Any]) -> DataType:
    fmt = node.get("format")
    if fmt == "date-time":
        return TimestampType()
    if fmt == "date":
        return DateType()
    if fmt == "decimal":
        precision = node.get("maxDigits")
        scale = node.get("decimalPlaces")
        if precision is None:
            precision = _DEFAULT_DECIMAL[0]
            scale = _DEFAULT_DECIMAL[1] if scale is None else scale
        scale = 0 if scale is None else scale
        if precision > _MAX_DECIMAL_PRECISION:
            raise TypedDecodingError(
                f"A Decimal with max_digits={precision} does not fit Spark's decimal (at most "
                f"{_MAX_DECIMAL_PRECISION} digits); lower max_digits or store it as a string."
            )
        return DecimalType(precision, min(scale, precision))
    return StringType()


def _json_kind(values: Iterable[Any]) -> str | None:
    kinds = {type(v) for v in values}
    if kinds <= {str}:
        return "string"
    if kinds <= {bool}:
        return "boolean"
    if kinds <= {int}:
        return "integer"
    if kinds <= {int, float}:
        return "number"
    return None


# -- typed frames ------------------------------------------------------------------------------


def _resolve(registry: TypeRegistry, event_type: str | type[BaseModel]) -> tuple[str, type[BaseModel], int]:
    if isinstance(event_type, str):
        model, current = registry.model_for(event_type)
        return event_type, model, current
    name, current = registry.name_of(event_type)
    return name, event_type, current


def typed_events(
    events: DataFrame,
    registry: TypeRegistry,
    event_type: str | type[BaseModel],
    *,
    flatten: bool = True,
) -> DataFrame:
    """The events of ``event_type`` with their payload parsed into columns of the current schema.

    ``events`` has the columns of :data:`spark_projections.source.EVENTS_SCHEMA`
    (at least ``type``, ``schema_version`` and ``payload``). ``event_type`` is a
    stored type name or a model registered in ``registry``. The result keeps
    every event column except ``payload`` (``schema_version`` then says the
    current version, which the data now has) and adds the model's fields as
    columns (``flatten=True``; a field named like an event column raises
    :class:`TypedDecodingError`) or as one struct column ``data``.
    """
    name, model, current = _resolve(registry, event_type)
    schema = spark_schema(model)
    rows = events.where(F.col("type") == F.lit(name))
    if current > 1:
        rows = _upcast(rows, registry, name, current)
    parsed = F.from_json(F.col("payload"), schema, {"mode": "FAILFAST"})
    keep = [F.col(c) for c in rows.columns if c != "payload"]
    if not flatten:
        return rows.select(*keep, parsed.alias(DATA_COLUMN))
    clashes = sorted(set(schema.fieldNames()) & {c for c in rows.columns if c != "payload"})
    if clashes:
        raise TypedDecodingError(
            f"{model.__qualname__} has fields named like event columns ({', '.join(clashes)}); call "
            f"typed_events(..., flatten=False) to get its fields in a struct column {DATA_COLUMN!r}."
        )
    field_columns: list[Column] = [F.col(f"{DATA_COLUMN}.`{field}`").alias(field) for field in schema.fieldNames()]
    return rows.select(*keep, parsed.alias(DATA_COLUMN)).select(*keep, *field_columns)


def typed_frames(
    events: DataFrame,
    registry: TypeRegistry,
    types: Iterable[str | type[BaseModel]] | None = None,
    *,
    flatten: bool = True,
) -> dict[str, DataFrame]:
    """One :func:`typed_events` DataFrame per stored type name (default: every type in ``registry``)."""
    chosen = list(registry.types()) if types is None else list(types)
    out: dict[str, DataFrame] = {}
    for event_type in chosen:
        name = _resolve(registry, event_type)[0]
        out[name] = typed_events(events, registry, event_type, flatten=flatten)
    return out


def _upcast(rows: DataFrame, registry: TypeRegistry, type_name: str, current: int) -> DataFrame:
    """Rewrite payloads older than ``current`` as the current model's JSON, in a ``mapInArrow`` task."""
    columns = rows.columns
    version_at = columns.index("schema_version")
    payload_at = columns.index("payload")

    def upcast(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            versions = batch.column(version_at)
            old = pc.fill_null(pc.less(versions, current), False)
            if not pc.any(old).as_py():
                yield batch
                continue
            which = pc.indices_nonzero(old)
            stored_versions = pc.take(versions, which).to_pylist()
            payloads = pc.take(batch.column(payload_at), which).to_pylist()
            upcast_payloads = [
                registry.decode(type_name, version, payload).model_dump_json()
                for version, payload in zip(stored_versions, payloads)
            ]
            arrays = list(batch.columns)
            arrays[payload_at] = pc.replace_with_mask(arrays[payload_at], old, pa.array(upcast_payloads, pa.string()))
            arrays[version_at] = pc.if_else(old, pa.scalar(current, versions.type), versions)
            yield pa.RecordBatch.from_arrays(arrays, schema=batch.schema)

    return rows.mapInArrow(upcast, rows.schema)

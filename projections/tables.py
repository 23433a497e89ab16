"""Read-model tables, declared once on the projection and understood by every backend.

A table has a name, key columns and typed columns. Column types are plain
Python types, so each backend maps them without guessing:

=========  ===========  ==============  =========================================
Python     SQLite       Spark / Delta   notes
=========  ===========  ==============  =========================================
``str``    TEXT         StringType
``int``    INTEGER      LongType        64-bit signed; ``bool`` is refused
``float``  REAL         DoubleType      an ``int`` value is stored as ``float``
``bool``   INTEGER 0/1  BooleanType     read back as ``bool``
``bytes``  BLOB         BinaryType
=========  ===========  ==============  =========================================

``T | None`` (or ``Optional[T]``) makes a column nullable. Key columns are
never nullable. Every write is checked against the declaration
(:meth:`Table.row`), the same way in every backend, so a handler that works on
SQLite cannot produce a different table in Spark.

Example::

    Table("balances", key="account_id",
          columns={"account_id": str, "owner": str, "balance": int, "closed_at": str | None})
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ProjectionDefinitionError, RowError

__all__ = ["COLUMN_TYPES", "Column", "Key", "Row", "Table"]

Key = Any
"""A row's key: the key column's value for a one-column key, else a tuple of the key columns' values."""

Row = dict[str, Any]
"""A row: every column name (key columns included) mapped to its value."""

COLUMN_TYPES: dict[type, str] = {str: "TEXT", int: "INTEGER", float: "REAL", bool: "INTEGER", bytes: "BLOB"}
"""The column types a table may declare, with their SQLite storage type."""

MAX_TABLE_NAME = 40
"""The longest table name: ``<name>__g<generation>__i<index>`` must stay within PostgreSQL's 63 bytes."""

_RESERVED_PREFIXES = ("pg_", "sqlite_", "_jetsourcing")
_RESERVED_BY = {"pg_": "PostgreSQL's catalogs", "sqlite_": "SQLite's catalogs", "_jetsourcing": "jetsourcing's bookkeeping"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
_TYPE_NAMES = {str: "str", int: "int", float: "float", bool: "bool", bytes: "bytes"}


def _as_int(value: Any) -> int:
    return int(value)


def plain_text(value: Any) -> bool:
    """True for text every backend stores as is (the fast, common case: ASCII without NUL)."""
    return bool(value.isascii() and "\x00" not in value)


def check_name(kind: str, name: object) -> str:
    """Return ``name`` if it can name a table, column or projection everywhere (SQL, Spark, KV keys)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.lower().startswith("_jetsourcing"):
        raise ProjectionDefinitionError(
            f"Invalid {kind} name {name!r}: use letters, digits and '_' (at most 63 characters), starting with "
            "a letter or '_', and not starting with '_jetsourcing' (reserved)."
        )
    return name


def check_table_name(name: object) -> str:
    """Return ``name`` if it can name a table in every backend, beside the database's own and the stores' names.

    Refused, whatever the case (SQLite ignores case, and both stores must agree): names SQLite or PostgreSQL
    keep for their catalogs (``sqlite_*``, ``pg_*``, ``information_schema``) or jetsourcing for its bookkeeping
    (``_jetsourcing*``), names with ``__`` (the stores name each generation's tables and indexes
    ``balances__g12__i0``, so a declared name can never be one of them), and names over
    :data:`MAX_TABLE_NAME` characters.
    """
    if isinstance(name, str):
        folded = name.lower()
        # A name's generation tables ('pg' -> 'pg__g1') must not fall under a reserved prefix either.
        prefix = next((p for p in _RESERVED_PREFIXES if (folded + "_").startswith(p)), None)
        if prefix is not None or folded == "information_schema":
            what = f"{prefix}* names belong to {_RESERVED_BY[prefix]}" if prefix else (
                "information_schema is the SQL standard's catalog")
            raise ProjectionDefinitionError(
                f"Table name {name!r} is reserved: {what} (in any letter case). Rename the table."
            )
    check_name("table", name)
    assert isinstance(name, str)
    if "__" in name:
        raise ProjectionDefinitionError(
            f"Table name {name!r} contains '__', which the stores keep for each generation's tables and indexes "
            "(balances__g12__i0). Rename the table (e.g. with a single '_')."
        )
    if len(name) > MAX_TABLE_NAME:
        raise ProjectionDefinitionError(
            f"Table name {name!r} is {len(name)} characters long; use at most {MAX_TABLE_NAME}: the stores name "
            "each generation's tables and indexes after it (balances__g12__i0), and PostgreSQL cuts names "
            "at 63 bytes. Rename the table."
        )
    return name


@dataclass(frozen=True, slots=True)
class Column:
    """One declared column: its name, Python type (see :data:`COLUMN_TYPES`) and whether it may be None."""

    name: str
    type: type
    nullable: bool

    @property
    def type_name(self) -> str:
        """The type's name: ``str``, ``int``, ``float``, ``bool`` or ``bytes``."""
        return _TYPE_NAMES[self.type]


def _parse_type(table: str, column: str, annotation: object) -> tuple[type, bool]:
    if isinstance(annotation, type) and annotation in COLUMN_TYPES:
        return annotation, False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1 and members[0] in COLUMN_TYPES and len(typing.get_args(annotation)) == 2:
            return members[0], True
    raise ProjectionDefinitionError(
        f"Column {table}.{column} has type {annotation!r}; use str, int, float, bool or bytes, "
        "or one of them '| None' for a nullable column."
    )


class Table:
    """A read-model table: name, key columns and typed columns. Immutable; equal when the declarations are.

    ``name`` is letters, digits and '_' (at most 40, without ``__`` and the
    catalogs' prefixes: see :func:`check_table_name`), checked here.
    ``key`` names one column (rows are then addressed by that column's value)
    or several (rows are addressed by a tuple of their values, in ``key``
    order). ``indexes`` lists secondary indexes for readers' queries, each one
    column name or a sequence of names; backends without indexes ignore them.
    """

    __slots__ = ("name", "key", "columns", "indexes", "_by_name", "_names", "_values", "_single", "_key_types")

    def __init__(
        self,
        name: str,
        *,
        key: str | Sequence[str],
        columns: Mapping[str, object],
        indexes: Sequence[str | Sequence[str]] = (),
    ) -> None:
        self.name = check_table_name(name)
        if not columns:
            raise ProjectionDefinitionError(f"Table {name!r} declares no columns.")
        cols = []
        for column, annotation in columns.items():
            check_name("column", column)
            col_type, nullable = _parse_type(name, column, annotation)
            cols.append(Column(column, col_type, nullable))
        self.columns: tuple[Column, ...] = tuple(cols)
        self._by_name = {c.name: c for c in cols}
        self._names = self._by_name.keys()
        key_names = (key,) if isinstance(key, str) else tuple(key)
        if not key_names or len(set(key_names)) != len(key_names):
            raise ProjectionDefinitionError(f"Table {name!r} needs one or more distinct key columns, got {key!r}.")
        for k in key_names:
            if k not in self._by_name:
                raise ProjectionDefinitionError(f"Key column {k!r} of table {name!r} is not among its columns.")
            if self._by_name[k].nullable:
                raise ProjectionDefinitionError(f"Key column {name}.{k} is declared nullable; key columns never are.")
        self.key: tuple[str, ...] = key_names
        index_list = []
        for index in indexes:
            names = (index,) if isinstance(index, str) else tuple(index)
            for n in names:
                if n not in self._by_name:
                    raise ProjectionDefinitionError(f"Index column {n!r} of table {name!r} is not among its columns.")
            index_list.append(names)
        self.indexes: tuple[tuple[str, ...], ...] = tuple(index_list)
        self._values = tuple((c.name, c.type, c.nullable) for c in cols if c.name not in key_names)
        self._single = len(key_names) == 1
        self._key_types = tuple(self._by_name[k].type for k in key_names)

    # -- description ---------------------------------------------------------

    @property
    def column_names(self) -> tuple[str, ...]:
        """Every column name, in declaration order (the order of rows' values in every backend)."""
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> Column:
        """The declared column ``name``."""
        try:
            return self._by_name[name]
        except KeyError:
            raise RowError(f"Table {self.name!r} has no column {name!r} (columns: {', '.join(self._by_name)}).") from None

    def spec(self) -> dict[str, Any]:
        """A JSON-able description; two tables with equal specs store rows identically."""
        return {
            "name": self.name,
            "key": list(self.key),
            "columns": [[c.name, c.type_name, c.nullable] for c in self.columns],
            "indexes": [list(i) for i in self.indexes],
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Table) and self.spec() == other.spec()

    def __hash__(self) -> int:
        return hash((self.name, self.key, self.columns, self.indexes))

    def __repr__(self) -> str:
        cols = ", ".join(f"{c.name}: {c.type_name}{' | None' if c.nullable else ''}" for c in self.columns)
        return f"Table({self.name!r}, key={self.key!r}, columns={{{cols}}})"

    # -- checking rows -------------------------------------------------------

    def key_values(self, key: Key) -> tuple[Any, ...]:
        """The key as a tuple of key-column values, checked against the declared key types."""
        values = (key,) if self._single else key
        if not isinstance(values, tuple) or len(values) != len(self.key):
            raise RowError(
                f"Bad key {key!r} for table {self.name!r}: "
                + (f"pass the value of {self.key[0]!r}." if self._single else f"pass a tuple of {self.key!r}.")
            )
        for name, typ, value in zip(self.key, self._key_types, values):
            if type(value) is not typ:
                raise RowError(
                    f"Bad key {key!r} for table {self.name!r}: {name!r} must be {_TYPE_NAMES[typ]}, "
                    f"not {type(value).__name__}."
                )
            if typ is int and not _INT_MIN <= _as_int(value) <= _INT_MAX:
                raise RowError(f"Key {name!r}={value} of table {self.name!r} does not fit in 64 bits.")
            if typ is str and not plain_text(value):
                self._check_text(name, value)
        return values

    def key_of(self, row: Mapping[str, Any]) -> Key:
        """The key of a full row (the form :meth:`Transaction.get` takes)."""
        if self._single:
            return row[self.key[0]]
        return tuple(row[k] for k in self.key)

    def row(self, key: Key, values: Mapping[str, Any]) -> Row:
        """The full row that ``upsert(table, key, values)`` stores, checked against the declaration.

        Key columns come from ``key`` (``values`` may repeat them, equal);
        nullable columns missing from ``values`` are None; a missing
        non-nullable column, an unknown column, or a value of the wrong type
        raises :class:`RowError`, as does text with a NUL character or a lone
        surrogate (no backend stores both the same way). ``int`` values of
        ``float`` columns become ``float``.
        """
        if self._single:
            key_name = self.key[0]
            key_type = self._key_types[0]
            if (type(key) is not key_type or (key_type is int and not _INT_MIN <= _as_int(key) <= _INT_MAX)
                    or (key_type is str and not plain_text(key))):
                self.key_values(key)  # raises the right error, if any
            row: Row = {key_name: key}
            if key_name in values and values[key_name] != key:
                self._mismatch(key_name, values, row)
        else:
            row = dict(zip(self.key, self.key_values(key)))
            for name in self.key:
                if name in values and values[name] != row[name]:
                    self._mismatch(name, values, row)
        if not self._names >= values.keys():
            unknown = sorted(set(values) - self._names)
            raise RowError(f"Table {self.name!r} has no column {unknown[0]!r} (columns: {', '.join(self._by_name)}).")
        for name, typ, nullable in self._values:
            value = values.get(name)
            if value is None:
                if not nullable:
                    raise RowError(f"Column {self.name}.{name} is not nullable; the row gives no value for it.")
            elif type(value) is not typ:
                value = self._coerce(name, typ, value)
                if typ is str:
                    self._check_text(name, value)
            elif typ is int and (value > _INT_MAX or value < _INT_MIN):  # type: ignore[operator]
                raise RowError(f"Value {value} of {self.name}.{name} does not fit in 64 bits.")
            elif typ is str and not plain_text(value):
                self._check_text(name, value)
            row[name] = value
        return row

    def _check_text(self, name: str, value: Any) -> None:
        # Every backend must store the same text: PostgreSQL refuses NUL, and no database stores a lone surrogate.
        if "\x00" in value:
            raise RowError(f"Text {value[:40]!r} of {self.name}.{name} contains a NUL character, which PostgreSQL "
                           "cannot store: strip it, or declare the column bytes.")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RowError(f"Text {value[:40]!r} of {self.name}.{name} has no UTF-8 form (a lone surrogate?): "
                           "store it as bytes, or repair the text.") from None

    def _mismatch(self, name: str, values: Mapping[str, Any], row: Row) -> None:
        raise RowError(f"Row for table {self.name!r} has {name}={values[name]!r} but its key says {row[name]!r}.")

    def _coerce(self, name: str, typ: type, value: Any) -> Any:
        if typ is float and type(value) is int:
            return float(value)
        if typ is not bool and type(value) is not bool and isinstance(value, typ):
            return typ(value)  # a subclass (e.g. a str enum): store the plain value
        raise RowError(
            f"Column {self.name}.{name} is {_TYPE_NAMES[typ]}, but the row gives {type(value).__name__} {value!r}."
        )

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "Table":
        """The table described by :meth:`spec` (as stored with a read model)."""
        by_name = {v: k for k, v in _TYPE_NAMES.items()}
        columns: dict[str, object] = {}
        for name, type_name, nullable in spec["columns"]:
            col_type = by_name[type_name]
            columns[name] = col_type | None if nullable else col_type
        return cls(spec["name"], key=spec["key"], columns=columns, indexes=spec.get("indexes", ()))

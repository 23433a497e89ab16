"""Defining projections and tables: checks at class creation and binding, dispatch, cheap skipping, public API."""

from __future__ import annotations

from typing import Optional

import pytest
from pydantic import BaseModel

import projections
from eventstore import RecordedEvent, StreamId, TypeRegistry
from projections import (
    MemoryStore,
    Projection,
    ProjectionDefinitionError,
    ProjectionLoadError,
    Table,
    Transaction,
    fold,
    handles,
)
from projections.cli import load_projection

from projection_examples import AccountBalances, Deposited, FragileBalances, Movements


def event(type_name: str, payload: bytes, position: int = 1, index: int = 0, registry: TypeRegistry | None = None,
          entity: str = "a1", version: int = 1) -> RecordedEvent:
    return RecordedEvent(position, index, StreamId("Account", entity), version, type_name, 1, f"id{position}.{index}",
                         payload, "2025-01-01T00:00:00+00:00", registry=registry)


def test_exported_names_are_sorted_and_exist() -> None:
    own = projections.__all__[: projections.__all__.index("run_daemon") + 1]
    assert own == sorted(own)
    for name in projections.__all__:
        assert getattr(projections, name) is not None


def test_handlers_by_class_and_by_name_resolve_to_stored_type_names() -> None:
    registry = TypeRegistry()
    balances = AccountBalances()
    balances.bind(registry)
    assert balances.handled_types == {"AccountOpened", "Deposited", "Withdrawn", "AccountClosed"}
    assert "Deposited" in registry  # class-keyed handlers register their events
    assert Movements().handled_types == {"Deposited", "Withdrawn", "AccountClosed"}
    assert FragileBalances().handled_types == balances.handled_types | {"Corrupted"}


def test_custom_registry_names_are_used() -> None:
    class Renamed(BaseModel):
        x: int

    registry = TypeRegistry()
    registry.register(Renamed, name="bank.Renamed")

    class P(Projection):
        name = "renamed"

        @handles(Renamed)
        def on(self, event: RecordedEvent, tx: Transaction) -> None:
            pass

    p = P()
    assert p.handled_types == {"Renamed"}  # unbound: the default rule
    p.bind(registry)
    assert p.handled_types == {"bank.Renamed"}


def test_unhandled_events_are_skipped_without_decoding() -> None:
    p = AccountBalances()
    store = MemoryStore.for_projection(p)
    # No registry: touching .data would raise LookupError; the payload is not even JSON.
    junk = event("SomethingElse", b"\xff not json")
    with store.transaction() as tx:
        assert p.apply(junk, tx) is False
    registry = TypeRegistry()
    p.bind(registry)
    opened = event("AccountOpened", b'{"owner":"x"}', 1, registry=registry)
    deposit = event("Deposited", Deposited(amount=5).model_dump_json().encode(), 2, registry=registry, version=2)
    fold(p, [opened, junk, deposit], store)
    assert store.rows("balances")[0]["balance"] == 5


def test_fold_is_what_spark_runs_per_entity() -> None:
    registry = TypeRegistry()
    p = AccountBalances()
    p.bind(registry)
    events = [
        event("AccountOpened", b'{"owner":"o"}', 1, registry=registry),
        event("Deposited", b'{"amount":10}', 2, registry=registry, version=2),
        event("Deposited", b'{"amount":20}', 3, 0, registry=registry, version=3),
        event("Withdrawn", b'{"amount":50}', 3, 1, registry=registry, version=4),
    ]
    store = fold(p, events)
    assert store.rows("balances") == [{
        "account_id": "a1", "owner": "o", "balance": -20, "deposits": 2, "withdrawals": 1, "last_position": 3,
        "average_deposit": 15.0, "overdrawn": True,
    }]


def test_a_class_without_a_name_is_abstract_until_instantiated() -> None:
    class Base(Projection):
        @handles("X")
        def x(self, event: RecordedEvent, tx: Transaction) -> None:
            pass

    with pytest.raises(ProjectionDefinitionError, match="has no name"):
        Base()

    class Concrete(Base):
        name = "concrete"

    assert Concrete().handled_types == {"X"}


def test_two_handlers_for_one_type_are_refused() -> None:
    with pytest.raises(ProjectionDefinitionError, match="twice"):
        class Twice(Projection):
            name = "twice"

            @handles("X")
            def a(self, event: RecordedEvent, tx: Transaction) -> None:
                pass

            @handles("X")
            def b(self, event: RecordedEvent, tx: Transaction) -> None:
                pass

    class ByNameAndClass(Projection):
        name = "both"

        @handles(Deposited)
        def a(self, event: RecordedEvent, tx: Transaction) -> None:
            pass

        @handles("Deposited")
        def b(self, event: RecordedEvent, tx: Transaction) -> None:
            pass

    with pytest.raises(ProjectionDefinitionError, match="both"):
        ByNameAndClass()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Table("bad name", key="a", columns={"a": str}), "Invalid table name"),
        (lambda: Table("_jetsourcing_x", key="a", columns={"a": str}), "reserved"),
        (lambda: Table("t" * 41, key="a", columns={"a": str}), "at most 40"),
        (lambda: Table("t", key="a", columns={"a": str | None}), "nullable"),
        (lambda: Table("t", key="b", columns={"a": str}), "not among its columns"),
        (lambda: Table("t", key="a", columns={"a": str, "b": list}), "has type"),
        (lambda: Table("t", key="a", columns={"a": str, "b": int | str}), "has type"),
        (lambda: Table("t", key="a", columns={}), "no columns"),
        (lambda: Table("t", key=(), columns={"a": str}), "key columns"),
        (lambda: Table("t", key="a", columns={"a": str}, indexes=["zz"]), "Index column"),
    ],
)
def test_bad_tables_are_refused(make: object, message: str) -> None:
    with pytest.raises(ProjectionDefinitionError, match=message):
        make()  # type: ignore[operator]


def test_optional_and_union_none_are_the_same_nullable_column() -> None:
    a = Table("t", key="k", columns={"k": int, "v": Optional[float]})  # noqa: UP007
    b = Table("t", key="k", columns={"k": int, "v": float | None})
    assert a == b and a.column("v").nullable
    assert Table.from_spec(a.spec()) == a


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"name": "has space"}, "Invalid projection name"),
        ({"name": "ok", "version": 0}, "version"),
        ({"name": "ok", "categories": "Account"}, "categories"),
        ({"name": "ok", "categories": ("not a category!",)}, "Invalid category"),
        ({"name": "ok", "tables": ("x",)}, "Table objects"),
        ({"name": "ok", "tables": (Table("t", key="a", columns={"a": str}),) * 2}, "twice"),
    ],
)
def test_bad_projection_attributes_are_refused(attrs: dict[str, object], message: str) -> None:
    with pytest.raises(Exception, match=message):
        type("Bad", (Projection,), dict(attrs))


def test_projection_import_paths_say_what_is_wrong() -> None:
    assert load_projection("projection_examples:AccountBalances").name == "account_balances"
    for path, message in (
        ("projection_examples.AccountBalances", "is not an import path"),
        ("no_such_module:X", "Cannot import 'no_such_module'"),
        ("projection_examples:Nope", "has no attribute 'Nope'"),
        ("json:dumps", "not a Projection subclass or instance"),
    ):
        with pytest.raises(ProjectionLoadError, match=message):
            load_projection(path)

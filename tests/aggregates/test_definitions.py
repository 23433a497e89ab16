"""Events and aggregates in memory: declaring them, recording, applying, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import aggregates
from aggregates import (
    Aggregate,
    AggregateDefinitionError,
    AggregateError,
    DomainError,
    DomainEvent,
    InvalidAggregateIdError,
    MissingHandlerError,
    applies,
    register_events,
    upcaster,
)
from eventstore import InvalidStreamIdError, TypeRegistry

from .domain import Account, AccountOpened, AccountState, Cart, Deposited, InsufficientFunds, Withdrawn


def test_public_names_are_exported_alphabetically() -> None:
    assert aggregates.__all__ == sorted(aggregates.__all__)
    for name in aggregates.__all__:
        assert getattr(aggregates, name).__doc__, f"{name} has no docstring"


# -- events -------------------------------------------------------------------


def test_event_type_name_defaults_to_the_class_name_and_version_to_1() -> None:
    assert (Deposited.__event_type__, Deposited.__schema_version__) == ("Deposited", 1)


def test_event_type_name_and_version_can_be_set() -> None:
    class MoneyIn(DomainEvent, type_name="Deposited", version=2):
        amount: int

    assert (MoneyIn.__event_type__, MoneyIn.__schema_version__) == ("Deposited", 2)
    registry = TypeRegistry()
    register_events(registry, [MoneyIn])
    assert registry.name_of(MoneyIn) == ("Deposited", 2)
    assert registry.model_for("Deposited") == (MoneyIn, 2)


def test_a_subclass_is_its_own_event_type() -> None:
    class Base(DomainEvent, type_name="Base", version=3):
        amount: int

    class Child(Base):
        note: str = ""

    assert (Child.__event_type__, Child.__schema_version__) == ("Child", 1)


def test_events_are_immutable_and_validated() -> None:
    event = Deposited(amount=5)
    with pytest.raises(ValidationError):
        event.amount = 6
    with pytest.raises(ValidationError):
        Deposited(amount="lots")  # type: ignore[arg-type]


def test_a_misspelt_field_is_refused_when_the_event_is_constructed() -> None:
    with pytest.raises(ValidationError, match="amont") as refused:
        Deposited(amount=5, amont=6)  # type: ignore[call-arg]
    assert [e["type"] for e in refused.value.errors()] == ["extra_forbidden"]


def test_mutable_events_are_refused() -> None:
    with pytest.raises(AggregateDefinitionError, match="immutable"):

        class Loose(DomainEvent, frozen=False):
            amount: int


@pytest.mark.parametrize("kwargs", [{"type_name": "has space"}, {"type_name": "a,b"}, {"version": 0}])
def test_bad_event_names_and_versions_are_refused_at_definition(kwargs: dict[str, Any]) -> None:
    with pytest.raises(AggregateDefinitionError):

        class Bad(DomainEvent, **kwargs):
            amount: int


def test_upcasters_attach_to_their_event_and_register_with_it() -> None:
    class Paid(DomainEvent, version=3):
        cents: int

    @upcaster(Paid, from_version=1)
    def one(data: dict[str, Any]) -> dict[str, Any]:
        return {"euros": data["amount"]}

    @upcaster(Paid, from_version=2)
    def two(data: dict[str, Any]) -> dict[str, Any]:
        return {"cents": data["euros"] * 100}

    registry = TypeRegistry()
    register_events(registry, [Paid])
    register_events(registry, [Paid])  # again: a no-op
    assert registry.decode("Paid", 1, b'{"amount": 2}') == Paid(cents=200)


@pytest.mark.parametrize("from_version", [0, 2, 5])
def test_upcasters_outside_the_versions_are_refused(from_version: int) -> None:
    class Paid(DomainEvent, version=2):
        cents: int

    with pytest.raises(AggregateDefinitionError):
        upcaster(Paid, from_version=from_version)(lambda data: data)


def test_two_upcasters_for_one_step_are_refused() -> None:
    class Paid(DomainEvent, version=2):
        cents: int

    upcaster(Paid, from_version=1)(lambda data: data)
    with pytest.raises(AggregateDefinitionError, match="already has an upcaster"):
        upcaster(Paid, from_version=1)(lambda data: data)


# -- aggregates ---------------------------------------------------------------


def test_a_new_aggregate_starts_empty() -> None:
    account = Account("alice")
    assert (account.id, account.version, account.position, account.pending) == ("alice", 0, 0, ())
    assert account.state == AccountState()
    assert Account.category == "Account" and Cart.category == "ShoppingCart"
    assert set(Account.event_types()) >= {AccountOpened, Deposited, Withdrawn}


def test_recording_applies_at_once_and_queues() -> None:
    account = Account("alice")
    account.open("Alice")
    assert account.deposit(10) == 10
    assert account.withdraw(3) == 7
    assert account.version == 3
    assert account.state.balance == 7 and account.state.owner == "Alice"
    assert account.pending == (AccountOpened(owner="Alice"), Deposited(amount=10), Withdrawn(amount=3))


def test_a_refused_command_records_nothing() -> None:
    account = Account("alice")
    account.open("Alice")
    account.deposit(5)
    with pytest.raises(InsufficientFunds) as info:
        account.withdraw(6)
    assert isinstance(info.value, DomainError) and isinstance(info.value, AggregateError)
    assert (account.version, account.state.balance, len(account.pending)) == (2, 5, 2)


def test_recording_an_event_without_handler_is_refused() -> None:
    class Unrelated(DomainEvent):
        pass

    account = Account("alice")
    with pytest.raises(MissingHandlerError, match="Account 'alice' has no handler for event type 'Unrelated'") as info:
        account.record(Unrelated())
    assert (info.value.aggregate, info.value.event_type, info.value.position) == ("Account", "Unrelated", None)
    assert (account.version, account.pending) == (0, ())


@pytest.mark.parametrize("bad_id", ["", "x" * 257, "tab\there", "nul\x00"])
def test_illegal_aggregate_ids_are_refused(bad_id: str) -> None:
    with pytest.raises(InvalidAggregateIdError) as info:
        Account(bad_id)
    assert isinstance(info.value, InvalidStreamIdError)


def test_any_printable_id_is_fine() -> None:
    assert Account("alice@example.com/β 1.*>").id == "alice@example.com/β 1.*>"


def test_an_aggregate_must_name_its_state() -> None:
    class Stateless(Aggregate):  # type: ignore[type-arg]
        pass

    with pytest.raises(AggregateDefinitionError, match=r"Aggregate\[YourState\]"):
        Stateless("x")


def test_state_fields_need_defaults() -> None:
    class Strict(BaseModel):
        owner: str

    with pytest.raises(AggregateDefinitionError, match="give every field a default"):

        class Bad(Aggregate[Strict]):
            pass


def test_two_handlers_for_one_event_are_refused() -> None:
    with pytest.raises(AggregateDefinitionError, match="two handlers for Deposited"):

        class Twice(Aggregate[AccountState]):
            @applies(Deposited)
            def _one(self, event: Deposited) -> None: ...

            @applies(Deposited)
            def _two(self, event: Deposited) -> None: ...


def test_applies_needs_an_event_class() -> None:
    with pytest.raises(AggregateDefinitionError):
        applies(AccountState)  # type: ignore[type-var]


def test_bad_category_is_refused() -> None:
    with pytest.raises(AggregateDefinitionError, match="Invalid category"):

        class Bad(Aggregate[AccountState], category="no spaces"):
            pass


def test_subclasses_inherit_and_override_handlers() -> None:
    class Bonus(Account, category="BonusAccount"):
        @applies(Deposited)
        def _deposited(self, event: Deposited) -> None:
            self.state.balance += event.amount * 2

    bonus = Bonus("b")
    bonus.open("B")
    bonus.deposit(5)
    assert bonus.state.balance == 10 and Bonus.category == "BonusAccount"
    plain = Account("p")
    plain.open("P")
    plain.deposit(5)
    assert plain.state.balance == 5

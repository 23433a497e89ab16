from __future__ import annotations

import pytest
from pydantic import BaseModel

from eventstore import EventDecodeError, InvalidEventError, TypeRegistry, UnknownEventTypeError


class Renamed(BaseModel):
    value: int


def test_registering_again_is_a_no_op_and_a_second_name_is_refused() -> None:
    registry = TypeRegistry()
    registry.register(Renamed, name="Custom", version=2)
    registry.register(Renamed)  # no-op: keeps "Custom" v2
    registry.register(Renamed, name="Custom")
    assert registry.name_of(Renamed) == ("Custom", 2)
    assert "Renamed" not in registry
    with pytest.raises(InvalidEventError, match="already registered as 'Custom'"):
        registry.register(Renamed, name="Other")


def test_type_names_must_be_safe_for_the_wire() -> None:
    registry = TypeRegistry()
    with pytest.raises(InvalidEventError, match="no commas"):
        registry.register(Renamed, name="a,b")
    with pytest.raises(InvalidEventError, match="not a pydantic model"):
        registry.register(dict)  # type: ignore[type-var]


def test_upcasters_chain_and_gaps_are_reported() -> None:
    class Moved(BaseModel):
        street: str
        city: str

    registry = TypeRegistry()
    registry.register(Moved, version=3)
    registry.register_upcaster("Moved", 1, lambda d: {"address": d["addr"]})
    registry.register_upcaster("Moved", 2, lambda d: dict(zip(("street", "city"), d["address"].split(", "))))
    assert registry.decode("Moved", 1, b'{"addr": "Main St 1, Oslo"}') == Moved(street="Main St 1", city="Oslo")
    assert registry.decode("Moved", 3, b'{"street": "s", "city": "c"}') == Moved(street="s", city="c")
    with pytest.raises(UnknownEventTypeError, match="newer than"):
        registry.decode("Moved", 4, b"{}")
    gappy = TypeRegistry()
    gappy.register(Moved, version=3)
    gappy.register_upcaster("Moved", 2, lambda d: d)
    with pytest.raises(EventDecodeError, match="no upcaster from version 1 to 2"):
        gappy.decode("Moved", 1, b"{}")


def test_a_stored_payload_that_is_not_json_is_a_decode_error_also_for_a_model_that_forbids_extra_fields() -> None:
    class Strict(BaseModel):
        model_config = {"extra": "forbid"}
        n: int

    registry = TypeRegistry()
    registry.register(Strict)
    for payload in (b"{not json", b'{"n": 1, "n2": '):
        with pytest.raises(EventDecodeError, match="does not validate"):
            registry.decode("Strict", 1, payload)
    assert registry.decode("Strict", 1, b'{"n": 1, "gone": 2}') == Strict(n=1)  # an extra field is left out

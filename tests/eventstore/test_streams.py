from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eventstore import InvalidStreamIdError, StreamId, decode_entity_id, encode_entity_id

_TOKEN_FORBIDDEN = set(".*> \t\r\n")


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=80))
def test_entity_ids_round_trip_through_a_legal_subject_token(entity_id: str) -> None:
    token = encode_entity_id(entity_id)
    assert token and not (_TOKEN_FORBIDDEN & set(token))
    assert token.isascii()
    assert decode_entity_id(token) == entity_id


def test_plain_ids_stay_readable_and_emails_are_escaped() -> None:
    assert encode_entity_id("order-42_A") == "order-42_A"
    assert encode_entity_id("alice@example.com") == "alice@example%2Ecom"
    sid = StreamId("Account", "alice@example.com")
    assert sid.subject("events") == "events.Account.alice@example%2Ecom"
    assert StreamId.from_subject(sid.subject("events"), "events") == sid
    assert StreamId.from_subject("a.b.Account.x%2Ey", "a.b") == StreamId("Account", "x.y")


def test_escaped_looking_ids_do_not_collide() -> None:
    assert encode_entity_id("a%2Eb") != encode_entity_id("a.b")


@pytest.mark.parametrize("category", ["", "has.dot", "has space", "1starts-with-digit", "star*", "gt>", "x" * 65])
def test_illegal_categories_are_rejected(category: str) -> None:
    with pytest.raises(InvalidStreamIdError, match="category"):
        StreamId(category, "1")


@pytest.mark.parametrize("entity_id", ["", "tab\there", "nul\x00", "x" * 257])
def test_illegal_entity_ids_are_rejected(entity_id: str) -> None:
    with pytest.raises(InvalidStreamIdError, match="entity id"):
        StreamId("Account", entity_id)


def test_parse_and_str_round_trip() -> None:
    sid = StreamId("Cart", "a/b")
    assert StreamId.parse(str(sid)) == sid
    with pytest.raises(InvalidStreamIdError):
        StreamId.parse("no-slash")

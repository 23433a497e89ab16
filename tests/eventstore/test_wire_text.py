"""The wire's text rules hold for every code point: what a header carries unchanged, how keys and entity ids are
escaped."""

from __future__ import annotations

import sys
import unicodedata
from urllib.parse import unquote

import pytest

from eventstore import InvalidArgumentError, InvalidStreamIdError
from eventstore.streams import decode_entity_id, encode_entity_id
from eventstore.wire import check_metadata, escape_key

_REFUSED = ("Cc", "Cs", "Zl", "Zp")  # controls, surrogates, line and paragraph separators
# Every character of those categories is in the Basic Multilingual Plane: all of it, and a stride through the others.
_CODE_POINTS = [*range(0x10000), *range(0x10000, sys.maxunicode + 1, 0x101), sys.maxunicode]


def test_metadata_is_refused_for_exactly_the_characters_a_header_cannot_carry() -> None:
    wrong = []
    for code in _CODE_POINTS:
        char = chr(code)
        try:
            check_metadata("correlation_id", f"a{char}b")
            refused = False
        except InvalidArgumentError:
            refused = True
        if refused != (unicodedata.category(char) in _REFUSED):
            wrong.append(hex(code))
    assert wrong == []


@pytest.mark.parametrize("value", [" a", "a\t", "\u2028", "a\x00b", "a\ud800"])
def test_refused_metadata_names_what_was_wrong(value: str) -> None:
    with pytest.raises(InvalidArgumentError, match="correlation_id .* contains"):
        check_metadata("correlation_id", value)


def test_escaping_keeps_printable_ascii_but_percent_and_escapes_the_rest_reversibly() -> None:
    kept = []
    for code in _CODE_POINTS:
        char = chr(code)
        escaped = escape_key(char)
        if escaped == char:
            kept.append(code)
        else:
            assert escaped.startswith("%") and unquote(escaped, errors="surrogatepass") == char, hex(code)
    assert kept == [c for c in range(0x21, 0x7F) if c != ord("%")]


def test_a_key_with_one_unsafe_character_among_safe_ones_is_escaped_there_only() -> None:
    assert escape_key("order-1 é%") == "order-1%20%C3%A9%25"


def test_entity_ids_keep_plain_ascii_refuse_controls_and_surrogates_and_escape_the_rest_reversibly() -> None:
    plain = set(range(0x21, 0x7F)) - {ord(c) for c in ".*>%"}
    wrong = []
    for code in _CODE_POINTS:
        char = chr(code)
        try:
            token = encode_entity_id(f"a{char}")
        except InvalidStreamIdError:
            if not (code < 0x20 or code == 0x7F or 0xD800 <= code <= 0xDFFF):
                wrong.append(hex(code))
            continue
        if code < 0x20 or code == 0x7F or 0xD800 <= code <= 0xDFFF:
            wrong.append(hex(code))  # accepted, though a subject cannot carry it
        elif (token == f"a{char}") != (code in plain) or decode_entity_id(token) != f"a{char}":
            wrong.append(hex(code))
    assert wrong == []

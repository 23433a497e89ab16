from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from eventstore.connection import parse_header_lines


@settings(max_examples=500)
@given(st.lists(st.tuples(st.binary(max_size=12), st.binary(max_size=12)), max_size=6))
def test_fast_header_parser_agrees_with_nats_py(pairs: list[tuple[bytes, bytes]]) -> None:
    raw = b"\r\n".join(key + b":" + value for key, value in pairs) + b"\r\n\r\n"
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


_ASCII = st.binary(max_size=12).map(lambda b: bytes(c & 0x7F for c in b))


@settings(max_examples=300)
@given(st.lists(st.tuples(_ASCII, _ASCII), max_size=6))
def test_fast_header_parser_agrees_with_nats_py_on_ascii_blocks(pairs: list[tuple[bytes, bytes]]) -> None:
    raw = b"\r\n".join(key + b":" + value for key, value in pairs) + b"\r\n\r\n"
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


def test_fast_header_parser_on_a_real_commit() -> None:
    raw = b"Nats-Msg-Id: abc\r\nEs-Type: Deposited,Withdrawn\r\nEs-Version:  7 \r\nbad key: x\r\n\r\n"
    assert parse_header_lines(raw) == {"Nats-Msg-Id": "abc", "Es-Type": "Deposited,Withdrawn", "Es-Version": "7"}

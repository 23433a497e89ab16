from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

import pytest

from eventstore import native, wire

# The Python twin and the native parser (the one readers use where it was built) must both agree with nats-py.
PARSERS = pytest.mark.parametrize("parse_header_lines", [wire.parse_header_lines, native.parse_header_lines],
                                  ids=["python", "native"])


@settings(max_examples=500)
@given(st.lists(st.tuples(st.binary(max_size=12), st.binary(max_size=12)), max_size=6))
@PARSERS
def test_fast_header_parser_agrees_with_nats_py(parse_header_lines, pairs: list[tuple[bytes, bytes]]) -> None:  # type: ignore[no-untyped-def]
    raw = b"\r\n".join(key + b":" + value for key, value in pairs) + b"\r\n\r\n"
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


_ASCII = st.binary(max_size=12).map(lambda b: bytes(c & 0x7F for c in b))


@settings(max_examples=300)
@given(st.lists(st.tuples(_ASCII, _ASCII), max_size=6))
@PARSERS
def test_fast_header_parser_agrees_with_nats_py_on_ascii_blocks(parse_header_lines, pairs: list[tuple[bytes, bytes]]) -> None:  # type: ignore[no-untyped-def]
    raw = b"\r\n".join(key + b":" + value for key, value in pairs) + b"\r\n\r\n"
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


@PARSERS
def test_fast_header_parser_on_a_real_commit(parse_header_lines) -> None:  # type: ignore[no-untyped-def]
    raw = b"Nats-Msg-Id: abc\r\nEs-Type: Deposited,Withdrawn\r\nEs-Version:  7 \r\nbad key: x\r\n\r\n"
    assert parse_header_lines(raw) == {"Nats-Msg-Id": "abc", "Es-Type": "Deposited,Withdrawn", "Es-Version": "7"}


def test_the_nats_py_hooks_are_on_a_tested_release() -> None:
    """eventstore.connection hooks into nats-py's private members: a release nobody tested fails here, loudly."""
    import inspect

    import nats.aio.client

    from eventstore.connection import HOOKS, TESTED_NATS_PY

    version = nats.aio.client.__version__
    assert version.rsplit(".", 1)[0] in TESTED_NATS_PY, (
        f"nats-py {version} is not among the releases eventstore/connection.py was tested with ({TESTED_NATS_PY}): "
        "check its hooks against this release, then add it to TESTED_NATS_PY and the pin in pyproject.toml."
    )
    client = Client()
    for name in HOOKS:
        assert hasattr(client, name), f"nats-py's Client has no {name} any more"
    assert isinstance(inspect.getattr_static(Client, "_parse_header_lines"), staticmethod)
    assert list(inspect.signature(Client._parse_header_lines).parameters) == ["raw"]
    assert list(inspect.signature(Client._process_info).parameters) == ["self", "info", "initial_connection"]
    assert "max_reconnect_attempts" in inspect.getsource(Client.connect)  # read back from options on reconnect

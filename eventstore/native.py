"""The native accelerator of bulk reads, or its Python twins: which one runs, and the functions readers call.

``eventstore/_native.c`` is compiled by the install where a C compiler is
found, for CPython's stable ABI. It frames whole runs of a consumer's messages
into events (every replay: ``read_all``, ``subscribe``, projection rebuilds and
daemons) or into Arrow views (the Spark reader), and parses header blocks. Each
of its functions has a Python twin that gives the same results, and a test
holds them to it; the Python twin runs where the module was not built, where it
was built from another version of the source, or when ``JETSOURCING_NATIVE=0``
is set.

The scanner's header names are this package's :class:`~eventstore.wire.Header`
names, handed to the C module here at import: they are defined once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

from .wire import Header
from .wire import parse_header_lines as python_parse_header_lines

__all__ = [
    "ACTIVE", "COLUMNS", "EventsResult", "SCANNED_HEADERS", "ScanResult", "events",
    "parse_header_lines", "scan",
]

COLUMNS: Final = 11
"""Columns of the scanner's views (see ``_native.c``)."""

SCANNED_HEADERS: Final = (
    Header.TYPE, Header.SCHEMA_VERSION, Header.EVENT_ID, Header.VERSION, Header.RECORDED_AT,
    Header.CORRELATION_ID, Header.CAUSATION_ID, Header.IDEMPOTENCY_KEY, Header.BATCH_ID,
)
"""The headers the accelerator reads: the scanner's columns in their order (the first five are required),
then the idempotency key and the atomic batch id, which :data:`events` reads too."""


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("JETSOURCING_NATIVE", "1") == "0":
        return None, "python (JETSOURCING_NATIVE=0)"
    try:
        from . import _native
    except ImportError:
        return None, "python (the native accelerator was not built: install a C compiler and reinstall)"
    if (_native.COLUMNS, _native.VIEW_SIZE) != (COLUMNS, 16):
        return None, "python (the native accelerator was built from another version: reinstall)"
    _native.headers(*(name.encode() for name in SCANNED_HEADERS))
    return _native, "native"


_module, ACTIVE = _load()
ACTIVE: str  # type: ignore[no-redef]
"""Which implementation runs: "native", or "python (why)"."""


def _native_parse(parse: Callable[[bytes], dict[str, str] | None]) -> Callable[[bytes], dict[str, str]]:
    def parse_header_lines(raw: bytes) -> dict[str, str]:
        fields = parse(raw)
        return fields if fields is not None else python_parse_header_lines(raw)  # not ASCII

    return parse_header_lines


parse_header_lines: Callable[[bytes], dict[str, str]] = (
    python_parse_header_lines if _module is None else _native_parse(_module.parse_headers)
)
"""A NATS header block's fields, exactly as nats-py parses them (native where it can)."""

ScanResult = tuple[int, int, int, int, int, int, bytearray, tuple[bytearray, ...], bytearray, bytearray]
"""What the scanner returns: (end, count, first_dseq, last_dseq, pending, several, positions, views,
correlation present, causation present); see ``_native.c``."""

scan: Callable[[bytes, int, bytes, bytes, bytes], ScanResult] | None = None if _module is None else _module.scan
"""The scanner of the Spark reader's runs (its Python twin is that reader's Python framing), or None."""

EventsResult = tuple[int, int, int, int, int, list[int], list[bytes], list[dict[str, str] | None], list[bytes], list[Any]]
"""What :data:`events` returns: (end, count, first_dseq, last_dseq, pending, positions, subjects, header dicts
or None, bodies, events or None)."""

events: Callable[..., EventsResult] | None = None if _module is None else _module.events
"""The framing of a replay's runs into events (see ``_native.c``): a plain commit becomes its event there, any
other keeps its header dict for :func:`eventstore.wire.decode_commit` (every one when ``new_event`` is None);
or None where the accelerator was not built."""

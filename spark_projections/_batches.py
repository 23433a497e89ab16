"""Pulled commits as Arrow record batches of events, however they were framed.

A batch's commits arrive either framed by the native scanner (:class:`Frames`:
Arrow binary views into the received bytes, see ``eventstore/_native.c``)
or as Python lists of raw messages (:class:`Commits`); :class:`Converter` turns
both into the columns of :data:`EVENTS_SCHEMA` with a few Arrow kernels.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType, TimestampType

from eventstore import EventDecodeError, Header, decode_entity_id
from eventstore.jetstream import Commits
from eventstore.native import COLUMNS
from eventstore.native import scan as native_scan


EVENTS_SCHEMA = StructType(
    [
        StructField("position", LongType()),
        StructField("index", IntegerType()),
        StructField("stream_id", StringType()),
        StructField("category", StringType()),
        StructField("entity_id", StringType()),
        StructField("version", LongType()),
        StructField("type", StringType()),
        StructField("schema_version", IntegerType()),
        StructField("event_id", StringType()),
        StructField("correlation_id", StringType()),
        StructField("causation_id", StringType()),
        StructField("recorded_at", TimestampType()),
        StructField("payload", StringType()),
    ]
)
"""Columns of an events DataFrame (all nullable, as Spark reports data source columns).

``position`` is the commit's stream sequence and ``index`` the event's place in
it, so ``(position, index)`` is unique and orders events globally; ``stream_id``
is ``"Category/entity-id"``; ``version`` the entity's version after the event;
``recorded_at`` a UTC timestamp; ``payload`` the event's stored JSON.
"""


# Columns of the native scanner's views, in its order (see eventstore/_native.c).
(_SUBJECT, _TYPE_COLUMN, _SCHEMA_COLUMN, _EVENT_ID_COLUMN, _VERSION_COLUMN, _RECORDED_COLUMN, _CORRELATION_COLUMN,
 _CAUSATION_COLUMN, _PAYLOAD, _CATEGORY, _ENTITY) = range(11)
_VIEW = 16  # bytes of one Arrow binary view
assert _ENTITY + 1 == COLUMNS, "the scanner's columns changed: update the constants above"


NATIVE = native_scan is not None
"""Whether the native scanner was built, for this version (else every message is framed in Python)."""


@dataclass(slots=True)
class Frames:
    """Commits framed by the native scanner: Arrow binary views into the bytes they arrived in.

    ``eventstore/_native.c`` checks each frame (our subscription and
    consumer, consecutive consumer sequences, the five required ``Es-*``
    headers once each) and cuts out the subject, the header values and the
    body without copying them; the Python path handles any other frame.
    """

    data: bytes
    count: int
    first_dseq: int
    last_dseq: int
    pending: int
    several: bool  # some commit holds several events
    positions: bytearray
    views: tuple[bytearray, ...]  # per column (see the constants above), 16 bytes per commit
    present: tuple[bytearray, bytearray]  # (correlation, causation): 1 where a commit has that optional header

    @classmethod
    def scan(
        cls, data: bytes, pos: int, sid: bytes, ack_prefix: bytes, subject_prefix: bytes
    ) -> tuple[int, Frames | None]:
        """Frame the run of our messages at ``data[pos:]``: (where it ends, the frames, or None when there are none)."""
        assert native_scan is not None, "check NATIVE first"
        end, count, first, last, pending, several, positions, views, correlation, causation = native_scan(
            data, pos, sid, ack_prefix, subject_prefix
        )
        if not count:
            return pos, None
        return end, cls(data, count, first, last, pending, bool(several), positions, views, (correlation, causation))

    def __len__(self) -> int:
        return self.count

    def head(self, keep: int) -> Frames:
        """The first ``keep`` commits."""
        return replace(self, count=keep, last_dseq=self.first_dseq + keep - 1)

    def position_list(self) -> Sequence[int]:
        return memoryview(self.positions).cast("q")[: self.count]

    def view_bytes(self, c: int) -> memoryview:
        """The binary views of column ``c`` (see the constants above), 16 bytes per commit."""
        return memoryview(self.views[c])[: self.count * _VIEW]

    def where(self, i: int) -> str:
        """Where commit ``i`` is stored, for error messages."""
        subject = _views_column([self], _SUBJECT)[i].as_py()
        return f"position {self.position_list()[i]} on {subject.decode(errors='replace')}"


def _views_column(runs: Sequence[Frames], c: int) -> pa.Array:
    """Column ``c`` of several runs as one binary-view array over their received bytes (no copy of the values)."""
    views = bytearray(b"".join(run.view_bytes(c) for run in runs))
    if len(runs) > 1:
        # Each run's views point into its own bytes (buffer 0): renumber them to buffer i for run i.
        table = np.frombuffer(views, dtype=np.int32).reshape(-1, 4)
        run_of_row = np.repeat(np.arange(len(runs), dtype=np.int32), [run.count for run in runs])
        outlined = table[:, 0] > 12  # longer values live in the buffer; shorter ones inside the view
        table[outlined, 2] = run_of_row[outlined]
    buffers = [None, pa.py_buffer(views), *(pa.py_buffer(run.data) for run in runs)]
    return pa.Array.from_buffers(pa.binary_view(), len(views) // _VIEW, buffers)


def _present(runs: Sequence[Frames], which: int) -> pa.Array:
    """Whether each commit of ``runs`` has the optional header ``which`` (0 correlation, 1 causation id)."""
    return pa.array(np.frombuffer(b"".join(run.present[which][: run.count] for run in runs), dtype=np.bool_))


def _where_in(runs: Sequence[Frames], i: int) -> str:
    """:meth:`Frames.where` for commit ``i`` of several runs taken together."""
    if i < 0:
        i += sum(run.count for run in runs)
    for run in runs:
        if i < run.count:
            return run.where(i)
        i -= run.count
    raise IndexError(i)


Part: TypeAlias = Commits | Frames
"""What a drained batch holds: commits framed in Python (lists) or natively (views)."""


# Header values as the writer lays them out ("Name: value" lines after "NATS/1.0").
def _header_re(name: str) -> re.Pattern[bytes]:
    return re.compile(rb"\r\n" + re.escape(name.encode()) + rb":[ \t]*([^\r]*)")


_TYPE = _header_re(Header.TYPE)
_SCHEMA_VERSION = _header_re(Header.SCHEMA_VERSION)
_EVENT_ID = _header_re(Header.EVENT_ID)
_VERSION = _header_re(Header.VERSION)
_RECORDED_AT = _header_re(Header.RECORDED_AT)
_CORRELATION_ID = _header_re(Header.CORRELATION_ID)
_CAUSATION_ID = _header_re(Header.CAUSATION_ID)
_SEPARATOR = b"\r\n\x00"  # between header blocks: no header value can span it
_OTHER_HEADERS = frozenset({"schema_version", "event_id", "version", "recorded_at"})
# The five required headers in the order eventstore.wire.encode_commit writes them: one
# pass over a batch's headers instead of five. Any other layout takes the slower path.
_REQUIRED = (Header.TYPE, Header.SCHEMA_VERSION, Header.EVENT_ID, Header.VERSION, Header.RECORDED_AT)
_WRITER_LAYOUT = re.compile(b"".join(rb"\r\n" + re.escape(name.encode()) + rb": ([^\r]*)" for name in _REQUIRED))


Values: TypeAlias = "Sequence[bytes] | pa.Array"


@dataclass
class Fields:
    """One batch's commits as per-commit raw values, however they were framed; columns are built when asked for."""

    positions: pa.Array
    several: bool  # some commit holds several events
    types: Callable[[], Values]
    schemas: Callable[[], Values]
    event_ids: Callable[[], Values]
    versions: Callable[[], Values]
    recorded: Callable[[], Values]
    bodies: Callable[[], Values]
    streams: Callable[[], tuple[pa.Array, pa.Array]]  # (category, entity token) columns
    correlation: Callable[[], pa.Array]
    causation: Callable[[], pa.Array]
    where: Callable[[int], str]  # "position N on <subject>" of commit i, for error messages


class Converter:
    """Turns pulled commits into one Arrow record batch of events, with Arrow kernels wherever possible."""

    def __init__(self, prefix: str, columns: Sequence[str] = tuple(EVENTS_SCHEMA.fieldNames())) -> None:
        self._prefix = prefix + "."
        fields = {f.name: f for f in EVENTS_SCHEMA.fields}
        self._schema = to_arrow_schema(StructType([fields[c] for c in columns]), timezone="UTC")
        self._want = set(columns)

    def convert(self, commits: Commits) -> pa.RecordBatch:
        """One row per event of ``commits`` (in order), with the converter's columns of :data:`EVENTS_SCHEMA`."""
        count = len(commits)
        blocks = commits.headers
        blob = _SEPARATOR.join(blocks)

        def fields(types: list[bytes], schemas: list[bytes] = [], event_ids: list[bytes] = [],  # noqa: B006
                   versions: list[bytes] = [], recorded: list[bytes] = []) -> Fields:  # noqa: B006 - never mutated
            return Fields(
                pa.array(commits.positions, pa.int64()), b"," in b"".join(types), lambda: types, lambda: schemas,
                lambda: event_ids, lambda: versions, lambda: recorded, lambda: commits.bodies,
                lambda: self._split_subjects(commits.subjects, commits.where),
                lambda: _optional(_CORRELATION_ID, b"\r\nEs-Correlation-Id:", blob, blocks),
                lambda: _optional(_CAUSATION_ID, b"\r\nEs-Causation-Id:", blob, blocks),
                commits.where,
            )

        if not self._want & _OTHER_HEADERS:
            # Only the type is wanted: one cheap search, unless some commit holds several events.
            types = _TYPE.findall(blob)
            if len(types) == count and b"," not in b"".join(types):
                return self._build(fields(types), count)
        found = _WRITER_LAYOUT.findall(blob)
        if len(found) == count:
            types, schemas, event_ids, versions, recorded = (list(column) for column in zip(*found))
        else:  # headers in another order (another writer): one search per header
            types = _TYPE.findall(blob)
            schemas = _SCHEMA_VERSION.findall(blob)
            event_ids = _EVENT_ID.findall(blob)
            versions = _VERSION.findall(blob)
            recorded = _RECORDED_AT.findall(blob)
            if not (len(types) == len(schemas) == len(event_ids) == len(versions) == len(recorded) == count):
                _raise_malformed(commits)
        return self._build(fields(types, schemas, event_ids, versions, recorded), count)

    def convert_parts(self, parts: Sequence[Part]) -> Iterator[pa.RecordBatch]:
        """One batch per run of parts framed the same way (natively, or in Python), in order."""
        for native, run in itertools.groupby(parts, key=lambda part: isinstance(part, Frames)):
            if native:
                yield self.convert_frames([part for part in run if isinstance(part, Frames)])
            else:
                commits = Commits()
                for part in run:
                    if isinstance(part, Commits):
                        commits.extend(part)
                yield self.convert(commits)

    def convert_frames(self, runs: Sequence[Frames]) -> pa.RecordBatch:
        """The same batch from natively framed commits (their header values are already cut out)."""

        def column(c: int) -> Callable[[], pa.Array]:
            return lambda: _views_column(runs, c)

        def optional(c: int) -> Callable[[], pa.Array]:
            def build() -> pa.Array:
                present = _present(runs, c - _CORRELATION_COLUMN)
                if not pc.any(present).as_py():
                    return pa.nulls(len(present), pa.string())
                return pc.if_else(present, _text(_views_column(runs, c)), pa.scalar(None, pa.string()))

            return build

        joined = b"".join(memoryview(run.positions)[: run.count * 8] for run in runs)
        positions = pa.Array.from_buffers(pa.int64(), len(joined) // 8, [None, pa.py_buffer(joined)])
        return self._build(
            Fields(
                positions, any(run.several for run in runs), column(_TYPE_COLUMN), column(_SCHEMA_COLUMN),
                column(_EVENT_ID_COLUMN), column(_VERSION_COLUMN), column(_RECORDED_COLUMN), column(_PAYLOAD),
                lambda: (_views_column(runs, _CATEGORY), _views_column(runs, _ENTITY)),
                optional(_CORRELATION_COLUMN), optional(_CAUSATION_COLUMN), lambda i: _where_in(runs, i),
            ),
            len(positions),
        )

    def _build(self, fields: Fields, count: int) -> pa.RecordBatch:
        want = self._want
        columns: dict[str, pa.Array] = {"position": fields.positions}
        several = fields.several
        if want & {"stream_id", "category", "entity_id"}:
            categories, tokens = fields.streams()
            if want & {"stream_id", "entity_id"}:
                columns["entity_id"] = _unescape(_text(tokens))
            if want & {"stream_id", "category"}:
                columns["category"] = _text(categories)
            if "stream_id" in want:
                columns["stream_id"] = pc.binary_join_element_wise(columns["category"], columns["entity_id"], "/")
        if "version" in want or several:
            columns["last_version"] = _cast(fields.versions(), pa.int64(), Header.VERSION, fields.where)
        if "correlation_id" in want:
            columns["correlation_id"] = fields.correlation()
        if "causation_id" in want:
            columns["causation_id"] = fields.causation()
        if "recorded_at" in want:
            columns["recorded_at"] = _cast(fields.recorded(), _TIMESTAMP, Header.RECORDED_AT, fields.where)
        if several:
            return self._batch(_expand(columns, fields), count)
        # One event per commit (the common case): every column is per commit already.
        if "type" in want:
            columns["type"] = _text(fields.types())
        if "schema_version" in want:
            columns["schema_version"] = _cast(fields.schemas(), pa.int32(), Header.SCHEMA_VERSION, fields.where)
        if "event_id" in want:
            columns["event_id"] = _text(fields.event_ids())
        if "payload" in want:
            columns["payload"] = _text(fields.bodies())
        return self._batch(columns, count)

    def _batch(self, columns: dict[str, pa.Array], count: int) -> pa.RecordBatch:
        if "version" in self._want and "version" not in columns:
            columns["version"] = columns["last_version"]
        if "index" in self._want and "index" not in columns:
            columns["index"] = pa.repeat(pa.scalar(0, pa.int32()), count)
        return pa.RecordBatch.from_arrays([columns[f.name] for f in self._schema], schema=self._schema)

    def _split_subjects(self, raw: Sequence[bytes], where: Callable[[int], str]) -> tuple[pa.Array, pa.Array]:
        """(category, entity token) columns from ``<prefix>.<Category>.<entity token>`` subjects."""
        subjects = _text(raw)
        prefix = self._prefix
        parts = pc.split_pattern(pc.utf8_slice_codeunits(subjects, len(prefix)), pattern=".", max_splits=1)
        valid = pc.and_(pc.starts_with(subjects, prefix), pc.equal(pc.list_value_length(parts), 2))
        if not pc.all(valid).as_py():
            bad = pc.index(valid, False).as_py()
            raise EventDecodeError(
                f"Subject {subjects[bad].as_py()!r} is not an event subject under {prefix[:-1]!r}."
            )
        return pc.list_element(parts, 0), pc.list_element(parts, 1)


def _unescape(tokens: pa.Array) -> pa.Array:
    """Entity ids from subject tokens: %XX escapes (see eventstore.streams) decoded one by one."""
    escaped = pc.match_substring(tokens, "%")
    if not pc.any(escaped).as_py():
        return tokens
    decoded = [decode_entity_id(token) for token in pc.filter(tokens, escaped).to_pylist()]
    return pc.replace_with_mask(tokens, escaped, pa.array(decoded, pa.string()))


def _expand(commit: dict[str, pa.Array], fields: Fields) -> dict[str, pa.Array]:
    """Columns with one row per event when some commits hold several (lists split by Arrow kernels)."""
    type_lists = pc.split_pattern(_binary(fields.types()), pattern=b",")
    lengths = pc.list_value_length(type_lists)
    split: dict[str, pa.Array] = {}
    for name, values, separator in (("schema versions", fields.schemas(), b","), ("event ids", fields.event_ids(), b","),
                                    ("body lines", fields.bodies(), b"\n")):
        lists = pc.split_pattern(_binary(values), pattern=separator)
        same = pc.equal(pc.list_value_length(lists), lengths)
        if not pc.all(same).as_py():
            bad = pc.index(same, False).as_py()
            raise EventDecodeError(
                f"Malformed commit at {fields.where(bad)}: its {name} do not match its "
                f"{lengths[bad].as_py()} event types."
            )
        split[name] = pc.list_flatten(lists)
    parent = pc.list_parent_indices(type_lists)
    # A commit's events are rows offsets[c] .. offsets[c+1]-1; index = row - offsets[c].
    first_row = pc.take(type_lists.offsets.cast(pa.int64()), parent)
    index = pc.subtract(pa.array(range(len(parent)), pa.int64()), first_row)
    # Es-Version is the version after the commit's last event.
    version = pc.add(pc.subtract(pc.take(commit["last_version"], parent), pc.take(lengths.cast(pa.int64()), parent)),
                     pc.add(index, 1))
    out = {name: pc.take(array, parent) for name, array in commit.items()}
    out.update(
        {
            "index": index.cast(pa.int32()),
            "version": version,
            "type": _text(pc.list_flatten(type_lists)),
            "schema_version": _cast(split["schema versions"], pa.int32(), Header.SCHEMA_VERSION, fields.where),
            "event_id": _text(split["event ids"]),
            "payload": _text(split["body lines"]),
        }
    )
    return out


def _binary(values: Sequence[bytes | None] | pa.Array) -> pa.Array:
    """Plain binary (not views: not every kernel takes them) from bytes or an Arrow array."""
    return values.cast(pa.binary()) if isinstance(values, pa.Array) else pa.array(values, pa.binary())


def _text(values: Sequence[bytes | None] | pa.Array) -> pa.Array:
    """UTF-8 text from bytes (the cast validates the encoding)."""
    if isinstance(values, pa.Array):
        return values if values.type == pa.string() else values.cast(pa.string())
    return pa.array(values, pa.binary()).cast(pa.string())


_TIMESTAMP = pa.timestamp("us", tz="UTC")


def _cast(values: Sequence[bytes] | pa.Array, arrow_type: pa.DataType, header: str,
          where: Callable[[int], str]) -> pa.Array:
    """The values of ``header`` as ``arrow_type``; a clear error naming the header and the commits if one is not."""
    try:
        return _text(values).cast(arrow_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise EventDecodeError(
            f"A commit between {where(0)} and {where(-1)} carries a malformed {header} header: {exc}"
        ) from exc


def _optional(pattern: re.Pattern[bytes], name: bytes, blob: bytes, blocks: Sequence[bytes]) -> pa.Array:
    if name not in blob:  # a substring test is much cheaper than the regular expression
        return pa.nulls(len(blocks), pa.string())
    values = []
    for block in blocks:
        found = pattern.search(block)
        values.append(found.group(1) if found else None)
    return _text(values)


def _raise_malformed(commits: Commits) -> None:
    required = tuple(zip((_TYPE, _SCHEMA_VERSION, _EVENT_ID, _VERSION, _RECORDED_AT), _REQUIRED))
    for i, headers in enumerate(commits.headers):
        for pattern, name in required:
            if len(pattern.findall(headers)) != 1:
                raise EventDecodeError(
                    f"Message at {commits.where(i)} lacks a single {name} header: it was not written by "
                    "jetsourcing. Keep foreign messages off the event subjects."
                )

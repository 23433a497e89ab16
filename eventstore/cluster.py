"""A real 3-node (or N-node) JetStream cluster of child ``nats-server`` processes, for tests and laptops.

Each node is an :class:`~eventstore.server.EmbeddedServer` with a name, a
cluster port with routes to every other node, a monitoring port, and its own
storage directory. The cluster answers the questions a failover test asks:
which node leads a stream, and when a new leader has been elected after one
was killed. It reads them from the nodes' monitoring endpoint (``/jsz``),
which answers even while JetStream has no leader.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import nats

from .errors import EventStoreError
from .jetstream.api import Subjects
from .server import EmbeddedServer, _free_port

__all__ = ["EmbeddedCluster"]


class EmbeddedCluster:
    """``nodes`` nats-servers with JetStream on 127.0.0.1, routed to each other as one cluster.

    Guarantees: :meth:`start` returns once every node accepts clients and the
    JetStream meta group has a leader, so a stream with ``replicas=nodes`` can
    be created at once; no node outlives this process; :meth:`kill`,
    :meth:`stop` and :meth:`start_node` keep a node's port and storage, so a
    restarted node rejoins with its data. ``url`` lists every node, so a client
    fails over to the nodes that are up. ``ports`` fixes the nodes' client
    ports (default: free ones), so that clients find a cluster started again.

    Example (an R3 event store that survives the loss of any one node)::

        with EmbeddedCluster(3) as cluster:
            settings = EventStoreSettings(nats_url=cluster.url, replicas=3)
            store = await EventStore.connect(settings)
            ...
            cluster.kill(cluster.stream_leader(settings.stream))
            await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)  # it polls: off the loop
    """

    def __init__(
        self,
        nodes: int = 3,
        storage_dir: str | Path | None = None,
        *,
        name: str = "jetsourcing",
        sync_always: bool = False,
        start_timeout_s: float = 30.0,
        ports: list[int] | None = None,
    ) -> None:
        if not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= 9:
            raise EventStoreError(f"EmbeddedCluster(nodes={nodes!r}): give a whole number of nodes from 1 to 9 (3 for R3).")
        if ports is not None and len(ports) != nodes:
            raise EventStoreError(f"EmbeddedCluster(ports={ports!r}): give one client port per node ({nodes}).")
        self._owns_dir = storage_dir is None
        self.storage_dir = Path(storage_dir) if storage_dir is not None else Path(tempfile.mkdtemp(prefix="jetsourcing-cluster-"))
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.cluster_ports = [_free_port() for _ in range(nodes)]
        self.http_ports = [_free_port() for _ in range(nodes)]
        routes = ", ".join(f"nats-route://127.0.0.1:{port}" for port in self.cluster_ports)
        self.nodes: list[EmbeddedServer] = []
        for i in range(nodes):
            config = "\n".join(
                [
                    f"server_name: {self.node_name(i)}",
                    f"http_port: {self.http_ports[i]}",
                    "cluster {",
                    f"  name: {name}",
                    f"  listen: 127.0.0.1:{self.cluster_ports[i]}",
                    f"  routes: [{routes}]",
                    "}",
                ]
            )
            self.nodes.append(
                EmbeddedServer(
                    self.storage_dir / self.node_name(i),
                    port=ports[i] if ports is not None else None,
                    sync_always=sync_always,
                    extra_config=config,
                    start_timeout_s=start_timeout_s,
                )
            )

    @staticmethod
    def node_name(index: int) -> str:
        """The server name of node ``index`` (``n1``, ``n2``, ...), as the cluster reports its leaders."""
        return f"n{index + 1}"

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated: what ``EventStoreSettings.nats_url`` takes."""
        return ",".join(node.url for node in self.nodes)

    @property
    def urls(self) -> list[str]:
        """Each node's client URL, by index."""
        return [node.url for node in self.nodes]

    def start(self) -> "EmbeddedCluster":
        """Start every node that is not running; return once a stream with a replica on every node can be created.

        That takes a meta leader that sees every node online: after a node
        restarts, the leader refuses to place replicas on it for a moment
        ("peer offline"), and after the meta leader itself was lost, until a
        new one is elected (about 5 s). A probe stream, created and deleted,
        is the one sure test.
        """
        for node in self.nodes:
            node.start()
        self._wait(self._can_place_everywhere, "JetStream to place a stream on every node")
        return self

    def start_node(self, index: int) -> None:
        """Start node ``index`` again on its port and storage; it rejoins the cluster and catches up."""
        self.nodes[index].start()

    def stop(self, index: int) -> None:
        """Stop node ``index`` gracefully (SIGTERM): it hands over its leaderships first."""
        self.nodes[index].stop()

    def kill(self, index: int) -> None:
        """Kill node ``index`` at once (SIGKILL), as a crash or a lost machine would."""
        self.nodes[index].kill()

    def running(self) -> list[int]:
        """The indexes of the nodes whose process is alive."""
        return [i for i, node in enumerate(self.nodes) if node.running]

    def meta_leader(self) -> int | None:
        """The index of the node leading JetStream's meta group, or None while there is none."""
        for _, jsz in self._views(""):
            leader = (jsz.get("meta_cluster") or {}).get("leader")
            if leader:
                return self._index(leader)
        return None

    def _can_place_everywhere(self) -> bool:
        async def probe() -> bool:
            name = f"JETSOURCING_PROBE_{uuid.uuid4().hex[:8]}"
            config = {"name": name, "subjects": [f"_jetsourcing_probe.{name}"], "storage": "memory", "num_replicas": len(self.nodes)}
            nc = await nats.connect(self.urls, connect_timeout=1, max_reconnect_attempts=0, allow_reconnect=False)
            try:
                reply = await nc.request(Subjects(name).stream_create(), json.dumps(config).encode(), timeout=2)
                if "error" in json.loads(reply.data or b"{}") or not reply.data:
                    return False
                await nc.request(Subjects(name).stream_delete(), b"", timeout=2)
                return True
            finally:
                await nc.close()

        result: list[bool] = []

        def run() -> None:
            try:
                result.append(asyncio.run(probe()))
            except Exception:  # a node still starting, an election: ask again
                result.append(False)

        # Its own thread and event loop: start() is called from sync and async code alike.
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
        return bool(result and result[0])

    def stream_leader(self, stream: str) -> int | None:
        """The index of the node leading ``stream``'s replicas, or None while it has no leader."""
        for _, jsz in self._views("?streams=true"):
            for account in jsz.get("account_details") or []:
                for detail in account.get("stream_detail") or []:
                    if detail.get("name") == stream:
                        leader = (detail.get("cluster") or {}).get("leader")
                        if leader and self.nodes[self._index(leader)].running:
                            return self._index(leader)
        return None

    def wait_for_stream_leader(self, stream: str, *, other_than: int | None = None, timeout_s: float = 30.0) -> int:
        """Wait until ``stream`` has a leader on a running node (other than ``other_than``); return its index.

        Raises :class:`~eventstore.errors.EventStoreError` after ``timeout_s``,
        e.g. when too few nodes run for a quorum.
        """
        found: list[int] = []

        def elected() -> bool:
            leader = self.stream_leader(stream)
            if leader is None or leader == other_than:
                return False
            found.append(leader)
            return True

        self._wait(elected, f"stream {stream!r} to elect a leader", timeout_s)
        return found[-1]

    def close(self) -> None:
        """Stop every node and delete the storage if this object created it."""
        for node in self.nodes:
            node.stop(timeout_s=5)
        if self._owns_dir:
            shutil.rmtree(self.storage_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedCluster":
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _index(self, server_name: str) -> int:
        return int(server_name.removeprefix("n")) - 1

    def _views(self, query: str) -> list[tuple[int, dict[str, Any]]]:
        views = []
        for i in self.running():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_ports[i]}/jsz{query}", timeout=2) as reply:
                    views.append((i, json.loads(reply.read())))
            except (OSError, urllib.error.URLError, ValueError):
                continue  # a node that is starting or stopping: ask the others
        return views

    def _wait(self, done: Callable[[], bool], what: str, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.start_timeout_s)
        while time.monotonic() < deadline:
            if done():
                return
            time.sleep(0.1)
        raise EventStoreError(
            f"The embedded cluster waited {timeout_s or self.start_timeout_s:.0f}s for {what} in vain; "
            f"running nodes: {[self.node_name(i) for i in self.running()]}. Check the nodes' logs in {self.storage_dir}."
        )

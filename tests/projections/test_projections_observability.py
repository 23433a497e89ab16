"""``--log-format json`` and ``--metrics-port``: a daemon's JSON logs, and its metrics scraped over HTTP."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from eventstore import EventStore
from projections import ProjectionSettings

from projection_examples import append_workload, workload
from projection_helpers import checkpoint, spawn, wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample at ``http://127.0.0.1:port/metrics``, keyed by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


async def test_a_daemon_logs_json_and_serves_its_lag_and_throughput(es: EventStore, psettings: ProjectionSettings) -> None:
    appends = workload(600, accounts=40)
    await append_workload(es, appends)
    port = free_port()
    proc = spawn(psettings, "run", "projection_examples:AccountBalances", "--log-format", "json",
                 "--metrics-port", str(port), stderr=subprocess.PIPE)
    label = (("projection", "account_balances"),)
    try:
        last = await es.last_position()
        await wait_until(lambda: checkpoint(psettings, "account_balances") == last, 30, "the daemon to catch up")

        def lag_is_zero() -> bool:
            return scrape(port).get(("jetsourcing_projection_lag_positions", label)) == 0.0

        await wait_until(lag_is_zero, 20, "a lag of 0 in the metrics")
        samples = scrape(port)
        events = sum(len(events) for _, events in appends)
        assert samples[("jetsourcing_projection_checkpoint", label)] == last
        assert samples[("jetsourcing_projection_events_total", label)] == events
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    assert proc.returncode == 0, stderr.decode()
    lines = [json.loads(line) for line in stderr.decode().splitlines()]  # every line is one JSON object
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    assert any("Received SIGTERM" in line["message"] for line in lines), lines


async def test_a_metrics_port_in_use_is_one_line(es: EventStore, psettings: ProjectionSettings) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = spawn(psettings, "run", "projection_examples:AccountBalances", "--metrics-port", str(port),
                     stderr=subprocess.PIPE)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    lines = stderr.decode().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"jetsourcing: Cannot serve metrics on 127.0.0.1:{port}"), lines

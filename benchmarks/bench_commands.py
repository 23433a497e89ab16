"""Benchmark of commands over NATS request-reply, against the same commands in-process and raw request-reply.

Run with the project's venv: ``.venv/bin/python benchmarks/bench_commands.py [--quick]``.
Starts its own nats-server in a temporary directory and worker processes of the
bank's command service (:func:`samples.bank.commands.command_service`); prints
progress to stderr and one JSON object as the last line of stdout.

1,000 accounts are opened, then deposits (64 at once, round robin over the
accounts) are measured in 3 interleaved rounds (medians reported; every round
in ``rounds``):

* ``inprocess_eps``: ``Repository.execute`` in this process (cache on);
* ``rr_eps_1``: ``CommandClient.send`` to one worker process;
* ``rr_eps_4``: the same to four worker processes in one queue group (each
  with its own cache: a command that lands on another worker than the
  account's previous one loads the account first, or conflicts and retries);
* ``raw_rr_eps``: plain nats-py request-reply to one process that answers each
  request at once, with a body of the same size: what the transport costs.

Targets: ``rr_eps_1`` ≥ 0.5× ``inprocess_eps`` (``targets.rr_1_over_inprocess``).
The machine has 2 cores: the client, the workers and the nats-server share them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the samples, when run from anywhere

import nats  # noqa: E402

from aggregates import CommandClient, Repository  # noqa: E402
from eventstore import EmbeddedServer, EventStore, EventStoreSettings  # noqa: E402
from samples.bank.account import Account  # noqa: E402
from samples.bank.commands import Deposit, OpenAccount, command_service  # noqa: E402

CONCURRENCY = 64
TODAY = date(2026, 1, 1)


def progress(text: str) -> None:
    print(f"[bench_commands] {text}", file=sys.stderr, flush=True)


async def worker(nats_url: str, stream: str, prefix: str, command_prefix: str) -> None:
    """A worker process: the bank's command service, or (command_prefix "raw") a plain nats-py echo responder."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    if command_prefix == "raw":
        nc = await nats.connect(nats_url)

        async def echo(msg: Any) -> None:
            await msg.respond(b'{"ok": true, "version": 1, "position": 1, "duplicate": false, "command_id": "x"}')

        await nc.subscribe("raw.echo", queue="raw", cb=echo)
        await nc.flush()
        print("ready", flush=True)
        await stop.wait()
        await nc.close()
        return
    async with EventStore.connect(EventStoreSettings(nats_url=nats_url, stream=stream, subject_prefix=prefix)) as store:
        async with command_service(store, subject_prefix=command_prefix):
            print("ready", flush=True)
            await stop.wait()


def start_workers(count: int, *args: str) -> list[subprocess.Popen[str]]:
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", *args], stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "a worker did not start"
    return procs


async def timed(count: int, one: Any) -> float:
    counter = iter(range(count))

    async def task() -> None:
        for i in counter:
            await one(i)

    started = time.perf_counter()
    await asyncio.gather(*(task() for _ in range(CONCURRENCY)))
    return count / (time.perf_counter() - started)


async def main(quick: bool) -> dict[str, Any]:
    accounts_n, per_round = (200, 2_000) if quick else (1_000, 6_000)
    ids = [f"acc-{i}" for i in range(accounts_n)]
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-commands-") as tmp, EmbeddedServer(tmp) as server:
        settings = EventStoreSettings(nats_url=server.url, stream="BANK", subject_prefix="bank")
        async with EventStore.connect(settings) as store:
            await store.ensure_stream()
            workers = {
                "rr_eps_1": start_workers(1, server.url, "BANK", "bank", "cmd1"),
                "rr_eps_4": start_workers(4, server.url, "BANK", "bank", "cmd4"),
                "raw_rr_eps": start_workers(1, server.url, "BANK", "bank", "raw"),
            }
            try:
                accounts = Repository(store, Account, cache_size=10_000)
                clients = {name: CommandClient(store, subject_prefix=f"cmd{name[-1]}") for name in ("rr_eps_1", "rr_eps_4")}
                await asyncio.gather(*(clients["rr_eps_1"].send(Account, i, OpenAccount(owner=i)) for i in ids))
                deposit = Deposit(amount=1, value_date=TODAY)
                body = json.dumps({"aggregate_id": ids[0], "command": deposit.model_dump(mode="json")}).encode()
                runs: dict[str, Any] = {
                    "inprocess_eps": lambda i: accounts.execute(ids[i % accounts_n], lambda a: a.deposit(1, TODAY)),
                    "rr_eps_1": lambda i: clients["rr_eps_1"].send(Account, ids[i % accounts_n], deposit),
                    "rr_eps_4": lambda i: clients["rr_eps_4"].send(Account, ids[i % accounts_n], deposit),
                    "raw_rr_eps": lambda i: store.nc.request("raw.echo", body, timeout=5),
                }
                for one in runs.values():  # warm up every path (caches, connections) once
                    await timed(accounts_n, one)
                rounds: dict[str, list[int]] = {name: [] for name in runs}
                for r in range(3):
                    for name, one in runs.items():
                        eps = await timed(per_round, one)
                        rounds[name].append(round(eps))
                        progress(f"round {r + 1}, {name}: {eps:,.0f}/s")
                total = accounts_n + 3 * (per_round * 3) + 3 * accounts_n  # opens, timed and warm-up deposits
                stored = (await store.info()).last_position
                assert stored == total, (stored, total)
            finally:
                for procs in workers.values():
                    for proc in procs:
                        proc.send_signal(signal.SIGTERM)
                codes = [proc.wait(15) for procs in workers.values() for proc in procs]
            assert codes == [0] * len(codes), f"workers did not drain and exit cleanly: {codes}"
    result.update({name: round(statistics.median(eps)) for name, eps in rounds.items()})
    result["rounds"] = rounds
    result["targets"] = {
        "rr_1_over_inprocess": round(result["rr_eps_1"] / result["inprocess_eps"], 3),
        "rr_4_over_inprocess": round(result["rr_eps_4"] / result["inprocess_eps"], 3),
        "rr_1_over_raw_rr": round(result["rr_eps_1"] / result["raw_rr_eps"], 3),
    }
    result["setup"] = {"accounts": accounts_n, "deposits_per_round": per_round, "concurrency": CONCURRENCY,
                       "cpus": os.cpu_count()}
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        asyncio.run(worker(*sys.argv[2:6]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run, for trying changes")
    print(json.dumps(asyncio.run(main(parser.parse_args().quick))))

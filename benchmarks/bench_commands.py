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
* ``rr_eps_4``: the same to four worker processes with routing (the default):
  each account's commands reach the worker that owns its partition, whose
  cache stays current;
* ``rr_eps_4_unrouted``: four workers without routing (``routing=False``): the
  queue group hands each command to any worker, whose copy of the account is
  then often stale (a conflict and a catch-up);
* ``bare_rr_eps``: plain nats-py request-reply to one process whose callback
  runs the same ``Repository.execute`` (with the command id) in a task and
  answers: the least any command worker does, without ``CommandService``'s
  decoding, validation, kept value, reply contract and metrics; its ratio
  ``rr_1_over_bare`` is what the framework's own code costs;
* ``raw_rr_eps``: plain nats-py request-reply to one process that answers each
  request at once, with a body of the same size: what the transport costs;
  ``raw_rr_eps_4``: the same to four such processes in a queue group (what four
  processes instead of one cost on this machine, whatever they run).

Each run deposits into 1,000 accounts of its own (opened first), so that no
run's writes make another run's caches stale.

Also measured: ``rr_cache_hit_rate_4``, the lowest of the four routed workers'
cache hit rates over a timed round (median of the rounds), and
``rr_settle_s``, the seconds from a routed worker's SIGKILL until the three
left own every partition between them (median of 3 kills, each followed by a
restart).

``cpu_us_per_command``: the CPU each process (this client, the one worker, the
nats-server) spent per command in the in-process, the one-worker and the bare
runs, from ``/proc``; ``wakeups_per_command``: how often the process doing the
execute (this client in-process, the worker otherwise) was switched out per
command (``/proc/<pid>/status``), a sign of how its work is cut up; ``rr_eps_1_ceiling``: what one worker could serve at most on these
cores with those costs (the busiest process alone, or all of them over the
cores).

Targets (#29): ``rr_eps_4`` ≥ ``rr_eps_1``; ``rr_cache_hit_rate_4`` ≥ 0.95;
``rr_eps_1`` ≥ 0.7× ``inprocess_eps``. The machine has 2 cores: the client, the
workers and the nats-server share them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the samples, when run from anywhere

import nats  # noqa: E402

from aggregates import DEFAULT_PARTITIONS, CommandClient, Repository  # noqa: E402
from aggregates.command_messages import COMMAND_ID_HEADER  # noqa: E402
from eventstore import EmbeddedServer, EventStore, EventStoreSettings  # noqa: E402
from samples.bank.account import Account  # noqa: E402
from samples.bank.commands import Deposit, OpenAccount, command_service  # noqa: E402

from harness import progress, run  # noqa: E402  (this script's folder is on sys.path)
from proc_cpu import context_switches, cpu_seconds  # noqa: E402

CONCURRENCY = 64
TODAY = date(2026, 1, 1)


async def worker(nats_url: str, stream: str, prefix: str, command_prefix: str) -> None:
    """A worker process: the bank's command service, or (command_prefix "raw") a plain nats-py echo responder.

    A routed worker answers ``stats.<command_prefix>`` with its cache counters and owned partitions.
    """
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    if command_prefix == "raw":
        nc = await nats.connect(nats_url)

        async def echo(msg: Any) -> None:
            await msg.respond(b'{"ok": true, "version": 1, "position": 1, "duplicate": false, "command_id": "x"}')

        await nc.subscribe("raw.echo4" if stream == "RAW4" else "raw.echo", queue="raw", cb=echo)
        await nc.flush()
        print("ready", flush=True)
        await stop.wait()
        await nc.close()
        return
    if command_prefix == "bare":
        await bare_worker(nats_url, stream, prefix, stop)
        return
    routing = not command_prefix.endswith("u")
    async with EventStore.connect(EventStoreSettings(nats_url=nats_url, stream=stream, subject_prefix=prefix)) as store:
        async with command_service(store, subject_prefix=command_prefix, routing=routing) as service:

            async def stats(msg: Any) -> None:
                cache = service.cache_stats.get("Account")
                owned = sorted(service.owned_partitions.get("Account", ()))
                await msg.respond(json.dumps({"hits": cache.hits if cache else 0, "total": (
                    cache.hits + cache.stale + cache.misses) if cache else 0, "owned": owned}).encode())

            await store.nc.subscribe(f"stats.{command_prefix}", cb=stats)
            await store.nc.flush()
            print("ready", flush=True)
            await stop.wait()


async def bare_worker(nats_url: str, stream: str, prefix: str, stop: asyncio.Event) -> None:
    """The least a command worker does: a nats-py callback hands each request to a task that runs the execute."""
    async with EventStore.connect(EventStoreSettings(nats_url=nats_url, stream=stream, subject_prefix=prefix)) as store:
        accounts = Repository(store, Account, cache_size=10_000)
        running: set[asyncio.Task[None]] = set()

        async def handle(msg: Any) -> None:
            request = json.loads(msg.data)
            command = Deposit.model_validate(request["command"])
            result = await accounts.execute(
                request["aggregate_id"], lambda a: a.deposit(command.amount, command.value_date),
                command_id=msg.headers[COMMAND_ID_HEADER],
            )
            await msg.respond(json.dumps({"ok": True, "version": result.version, "position": result.position}).encode())

        async def receive(msg: Any) -> None:
            task = asyncio.create_task(handle(msg))
            running.add(task)
            task.add_done_callback(running.discard)

        await store.nc.subscribe("bare.Account.Deposit", queue="bare", cb=receive)
        await store.nc.flush()
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


async def worker_stats(nc: Any, command_prefix: str, count: int) -> list[dict[str, Any]]:
    """Every live worker's answer to ``stats.<command_prefix>`` (waits up to 1 s for ``count`` of them)."""
    inbox = nc.new_inbox()
    answers: list[dict[str, Any]] = []
    enough = asyncio.Event()

    async def got(msg: Any) -> None:
        answers.append(json.loads(msg.data))
        if len(answers) >= count:
            enough.set()

    sub = await nc.subscribe(inbox, cb=got)
    await nc.publish(f"stats.{command_prefix}", b"", reply=inbox)
    try:
        await asyncio.wait_for(enough.wait(), 1.0)
    except asyncio.TimeoutError:
        pass
    await sub.unsubscribe()
    return answers


def lowest_hit_rate(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> float:
    """The lowest worker's hits over commands between two stats snapshots (matched by owned partitions' order)."""
    rates = []
    for b, a in zip(sorted(before, key=lambda s: s["owned"]), sorted(after, key=lambda s: s["owned"])):
        total = a["total"] - b["total"]
        if total:
            rates.append((a["hits"] - b["hits"]) / total)
    return min(rates) if rates else 0.0


async def settle_after_kill(nc: Any, procs: list[subprocess.Popen[str]], restart: Any, partitions: int) -> float:
    """SIGKILL one routed worker; the seconds until the others own every partition once; then restart one."""
    victim = procs.pop(0)
    started = time.perf_counter()
    victim.kill()
    victim.wait()
    while True:
        owned = [p for s in await worker_stats(nc, "cmd4", len(procs)) for p in s["owned"]]
        if sorted(owned) == list(range(partitions)):
            settled = time.perf_counter() - started
            break
        if time.perf_counter() - started > 60:
            raise AssertionError("the assignment did not settle within 60 s")
        await asyncio.sleep(0.02)
    procs.extend(restart())
    return settled


async def main(quick: bool) -> dict[str, Any]:
    accounts_n, per_round = (200, 2_000) if quick else (1_000, 6_000)
    # Each run deposits into accounts of its own, so that no run's writes make another's caches stale.
    names = ("inprocess_eps", "rr_eps_1", "rr_eps_4", "rr_eps_4_unrouted", "bare_rr_eps")
    ids = {name: [f"{name}-{i}" for i in range(accounts_n)] for name in names}
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-commands-") as tmp, EmbeddedServer(tmp) as server:
        settings = EventStoreSettings(nats_url=server.url, stream="BANK", subject_prefix="bank")
        async with EventStore.connect(settings) as store:
            await store.ensure_stream()
            workers = {
                "rr_eps_1": start_workers(1, server.url, "BANK", "bank", "cmd1"),
                "rr_eps_4": start_workers(4, server.url, "BANK", "bank", "cmd4"),
                "rr_eps_4_unrouted": start_workers(4, server.url, "BANK", "bank", "cmd4u"),
                "bare_rr_eps": start_workers(1, server.url, "BANK", "bank", "bare"),
                "raw_rr_eps": start_workers(1, server.url, "BANK", "bank", "raw"),
                "raw_rr_eps_4": start_workers(4, server.url, "RAW4", "bank", "raw"),
            }
            try:
                accounts = Repository(store, Account, cache_size=10_000)
                prefixes = {"rr_eps_1": "cmd1", "rr_eps_4": "cmd4", "rr_eps_4_unrouted": "cmd4u"}
                clients = {name: CommandClient(store, subject_prefix=p) for name, p in prefixes.items()}
                for name in names:
                    await asyncio.gather(*(clients["rr_eps_1"].send(Account, i, OpenAccount(owner=i)) for i in ids[name]))
                deposit = Deposit(amount=1, value_date=TODAY)
                deposit_json = deposit.model_dump(mode="json")
                body = json.dumps({"aggregate_id": ids["rr_eps_1"][0], "command": deposit.model_dump(mode="json")}).encode()

                def sender(name: str) -> Any:
                    return lambda i: clients[name].send(Account, ids[name][i % accounts_n], deposit)

                runs: dict[str, Any] = {
                    "inprocess_eps": lambda i: accounts.execute(
                        ids["inprocess_eps"][i % accounts_n], lambda a: a.deposit(1, TODAY)
                    ),
                    **{name: sender(name) for name in prefixes},
                    "bare_rr_eps": lambda i: store.nc.request(
                        "bare.Account.Deposit", json.dumps({"aggregate_id": ids["bare_rr_eps"][i % accounts_n],
                                                             "command": deposit_json}).encode(),
                        timeout=5, headers={COMMAND_ID_HEADER: str(uuid.uuid4())},
                    ),
                    "raw_rr_eps": lambda i: store.nc.request("raw.echo", body, timeout=5),
                    "raw_rr_eps_4": lambda i: store.nc.request("raw.echo4", body, timeout=5),
                }
                for one in runs.values():  # warm up every path (caches, connections) once
                    await timed(accounts_n, one)
                rounds: dict[str, list[float]] = {name: [] for name in runs}
                hit_rates: list[float] = []
                # Each process's CPU per command, to know the machine's ceiling for one worker (see the module docs).
                pids = {"client": os.getpid(), "worker": workers["rr_eps_1"][0].pid, "server": server.pid or 0}
                bare_pids = {**pids, "worker": workers["bare_rr_eps"][0].pid}
                measured = {"inprocess_eps": pids, "rr_eps_1": pids, "bare_rr_eps": bare_pids}
                cpu_us: dict[str, dict[str, list[float]]] = {name: {who: [] for who in pids} for name in measured}
                wakeups: dict[str, list[float]] = {name: [] for name in measured}
                for r in range(3):
                    for name, one in runs.items():
                        before = await worker_stats(store.nc, "cmd4", 4) if name == "rr_eps_4" else []
                        watched = measured.get(name, pids)
                        executor = watched["client" if name == "inprocess_eps" else "worker"]
                        cpu_before = {who: cpu_seconds(pid) for who, pid in watched.items()}
                        switches_before = context_switches(executor)
                        eps = await timed(per_round, one)
                        if name in measured:
                            for who, pid in watched.items():
                                cpu_us[name][who].append((cpu_seconds(pid) - cpu_before[who]) / per_round * 1e6)
                            wakeups[name].append((context_switches(executor) - switches_before) / per_round)
                        rounds[name].append(round(eps))
                        progress(f"round {r + 1}, {name}: {eps:,.0f}/s")
                        if name == "rr_eps_4":
                            hit_rates.append(round(lowest_hit_rate(before, await worker_stats(store.nc, "cmd4", 4)), 4))
                            progress(f"round {r + 1}, lowest routed worker's cache hit rate: {hit_rates[-1]:.4f}")
                settles = []
                for _ in range(3):
                    settles.append(round(await settle_after_kill(
                        store.nc, workers["rr_eps_4"], lambda: start_workers(1, server.url, "BANK", "bank", "cmd4"),
                        DEFAULT_PARTITIONS,
                    ), 2))
                    progress(f"a routed worker SIGKILLed: the others own every partition after {settles[-1]:.2f}s")
                    await asyncio.sleep(1.5)  # the new worker joins before the next kill
                total = 5 * accounts_n + 5 * (per_round * 3) + 5 * accounts_n  # opens, timed and warm-up deposits
                stored = (await store.info()).last_position
                assert stored == total, (stored, total)
            finally:
                for procs in workers.values():
                    for proc in procs:
                        proc.send_signal(signal.SIGTERM)
                codes = [proc.wait(15) for procs in workers.values() for proc in procs]
            assert codes == [0] * len(codes), f"workers did not drain and exit cleanly: {codes}"
    result["rr_cache_hit_rate_4"] = statistics.median(hit_rates)
    result["cpu_us_per_command"] = {
        name: {who: round(statistics.median(us)) for who, us in by_process.items()} for name, by_process in cpu_us.items()
    }
    # With every process's CPU per command known, the most one worker could serve on these cores: the busiest
    # process alone, or all of them together over the cores, whichever is slower.
    result["wakeups_per_command"] = {name: round(statistics.median(w), 3) for name, w in wakeups.items()}
    one = result["cpu_us_per_command"]["rr_eps_1"]
    result["rr_eps_1_ceiling"] = round(1e6 / max(max(one.values()), sum(one.values()) / (os.cpu_count() or 1)))
    result["rr_settle_s"] = statistics.median(settles)
    result.update({name: round(statistics.median(eps)) for name, eps in rounds.items()})
    result["rounds"] = rounds
    result["targets"] = {
        "rr_1_over_inprocess": round(result["rr_eps_1"] / result["inprocess_eps"], 3),
        "rr_4_over_inprocess": round(result["rr_eps_4"] / result["inprocess_eps"], 3),
        "rr_4_over_rr_1": round(result["rr_eps_4"] / result["rr_eps_1"], 3),
        "rr_4_unrouted_over_rr_1": round(result["rr_eps_4_unrouted"] / result["rr_eps_1"], 3),
        "rr_cache_hit_rate_4": result["rr_cache_hit_rate_4"],
        "rr_settle_s": result["rr_settle_s"],
        "rr_1_over_raw_rr": round(result["rr_eps_1"] / result["raw_rr_eps"], 3),
        # What CommandService's own code costs against a bare responder running the same execute.
        "rr_1_over_bare": round(result["rr_eps_1"] / result["bare_rr_eps"], 3),
        "bare_over_inprocess": round(result["bare_rr_eps"] / result["inprocess_eps"], 3),
        "rr_1_ceiling_over_inprocess": round(result["rr_eps_1_ceiling"] / result["inprocess_eps"], 3),
        # The transport's own scaling from one responder process to four, on this machine: the ceiling of rr_4_over_rr_1.
        "raw_4_over_raw_1": round(result["raw_rr_eps_4"] / result["raw_rr_eps"], 3),
    }
    result["setup"] = {"accounts": accounts_n, "deposits_per_round": per_round, "concurrency": CONCURRENCY,
                       "cpus": os.cpu_count()}
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        asyncio.run(worker(*sys.argv[2:6]))
        sys.exit(0)
    run(main, __doc__)

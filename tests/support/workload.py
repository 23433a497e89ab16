"""A fault-test workload and its checker: concurrent writers of multi-event and multi-entity commands that record
what the server acknowledged, and a read-back that proves nothing acknowledged was lost, nothing was stored twice,
no command was half stored and no entity's versions have gaps.

Used by the single-server and cluster fault tests and by ``benchmarks/faults.py``::

    workload = Workload(store, entities=500, writers=32)
    workload.start()
    ...                                   # kill the server, restart it, kill the leader, ...
    await workload.stop()                 # no new commands; the pending ones settle (or stay unresolved)
    report = await check(store, workload.ledger)
    report.assert_clean()                 # acked stored exactly once, no partial command, no gap, expected errors

Scenarios: :func:`kill_server` (SIGKILL and restart an :class:`~eventstore.EmbeddedServer` under the workload:
outage and recovery times) and :func:`kill_clients` (client processes SIGKILLed in ``append_many``). The
:class:`StepCounts` projection and :func:`read_model_equals_rebuild` check a daemon that ran through a fault.

Every command has a unique id, sent as the append's idempotency key (or the ``command_id`` of
:meth:`aggregates.Repository.execute`), so a writer that gets :class:`~eventstore.ServerUnavailableError`
resends the same command until it is acknowledged: a resend of a stored command must come back as a duplicate,
never be stored again. Each event (:class:`Step`) names its command, its part and how many parts the command
put on its entity, and every entity of the command: the stream alone tells whether a command is whole.

Three kinds of command, drawn at random per command:

* ``events``: several events on one entity (``EventStore.append``);
* ``entities``: one or two events on each of several entities, one atomic batch (``EventStore.append_many``);
* ``command``: several events on one aggregate through ``Repository.execute(..., command_id=...)``, the
  retrying command helper (it reloads and reruns on a :class:`~eventstore.ConcurrencyError`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from aggregates import Aggregate, DomainEvent, Repository, RetryPolicy, applies
from eventstore import ANY, EmbeddedServer, EntityAppend, EventStore, EventStoreSettings, RecordedEvent, StreamId
from projections import Daemon, Outcome, Projection, ProjectionSettings, SqliteStore, Table, Transaction, handles

__all__ = [
    "CATEGORY",
    "EXPECTED_ERRORS",
    "Command",
    "Ledger",
    "Report",
    "Step",
    "StepCounts",
    "Tally",
    "Workload",
    "check",
    "check_events",
    "client_kill_child_argv",
    "kill_clients",
    "kill_server",
    "projection_checkpoint",
    "read_model_equals_rebuild",
    "read_workload_events",
]

ROOT = Path(__file__).parent.parent.parent
CATEGORY = "Wk"
EXPECTED_ERRORS = frozenset({"ServerUnavailableError", "ConcurrencyError"})
"""The errors a writer may see during an outage or a failover: anything else is a defect."""

Kind = Literal["events", "entities", "command"]


class Step(DomainEvent, type_name="WorkStep"):
    """One event of a workload command: part ``part`` of ``parts`` on its entity; ``entities``: all of the command's."""

    command: str
    part: int
    parts: int
    entities: list[str]


class TallyState(BaseModel):
    steps: int = 0


class Tally(Aggregate[TallyState], category=CATEGORY):
    """The aggregate the ``command`` kind runs on: it counts its steps."""

    def step(self, command: str, parts: int) -> None:
        for part in range(parts):
            self.record(Step(command=command, part=part, parts=parts, entities=[self.id]))

    @applies(Step)
    def _stepped(self, event: Step) -> None:
        self.state.steps += 1


class StepCounts(Projection):
    """Per entity: its events, its last version and position, and the commands that wrote it."""

    name = "workload_steps"
    version = 1
    categories = (CATEGORY,)
    tables = (
        Table(
            "entities",
            key="entity_id",
            columns={"entity_id": str, "events": int, "commands": int, "last_version": int, "last_position": int},
        ),
    )

    @handles(Step)
    def stepped(self, event: RecordedEvent, tx: Transaction) -> None:
        data = event.data
        assert isinstance(data, Step)
        row = tx.get("entities", event.stream_id.entity_id) or {"events": 0, "commands": 0}
        tx.upsert("entities", event.stream_id.entity_id, {
            "events": row["events"] + 1,
            "commands": row["commands"] + (data.part == 0),
            "last_version": event.version,
            "last_position": event.position,
        })


@dataclass(frozen=True)
class Command:
    """What a writer sent: its id (the idempotency key), kind, and events per entity id."""

    id: str
    kind: Kind
    parts: dict[str, int]


@dataclass
class Ledger:
    """What the writers saw: every command sent, the acknowledged ones with (position, last version) per entity
    and when the acknowledgement arrived (``time.monotonic()``), and every error by type (with a few messages)."""

    sent: dict[str, Command] = field(default_factory=dict)
    acked: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    acked_at: dict[str, float] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    duplicate_acks: int = 0  # acknowledgements of a resent command that reported the first write (duplicate=True)
    slowest_call_s: float = 0.0  # the longest single call (success or failure) of any writer

    def error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.errors[name] += 1
        if len(self.error_samples[name]) < 5:
            self.error_samples[name].append(str(exc)[:600])

    def first_ack_after(self, t: float) -> float | None:
        """The first acknowledgement at or after ``t`` (monotonic), if any."""
        return min((a for a in self.acked_at.values() if a >= t), default=None)

    def acked_after(self, t: float) -> Counter[Kind]:
        """How many commands of each kind were acknowledged at or after ``t`` (monotonic)."""
        return Counter(self.sent[c].kind for c, a in self.acked_at.items() if a >= t)


class Workload:
    """``writers`` tasks running commands over ``entities`` entities of :data:`CATEGORY` until :meth:`stop`.

    A command that fails is resent with the same id after a short backoff (growing to ``max_backoff_s``),
    whatever the error, until acknowledged, so an outage shows as errors and then as success; every error
    is counted by type in the ledger. ``kinds`` restricts the command kinds; ``pause_s`` spaces a writer's
    commands (0: as fast as the server answers).
    """

    def __init__(
        self,
        store: EventStore,
        *,
        entities: int = 500,
        writers: int = 32,
        max_events: int = 4,
        max_entities: int = 6,
        kinds: tuple[Kind, ...] = ("events", "entities", "command"),
        seed: int = 0,
        pause_s: float = 0.0,
        max_backoff_s: float = 0.5,
        tag: str = "",
    ) -> None:
        self.store = store
        self.ids = [f"e{i:05d}" for i in range(entities)]
        self.writers = writers
        self.max_events = max_events
        self.max_entities = min(max_entities, entities)
        self.kinds = kinds
        self.pause_s = pause_s
        self.max_backoff_s = max_backoff_s
        self.tag = tag or uuid.uuid4().hex[:8]  # command ids unique across workloads on one stream
        self.ledger = Ledger()
        self.repository = Repository(store, Tally, retry=RetryPolicy(attempts=200, max_delay_s=0.1))
        store.registry.register(Step)
        self._rng = random.Random(seed)
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the writers."""
        self._stopping.clear()
        for w in range(self.writers):
            rng = random.Random(self._rng.getrandbits(64))
            self._tasks.append(asyncio.create_task(self._writer(w, rng), name=f"workload-writer-{w}"))

    async def stop(self, settle_s: float = 30.0) -> None:
        """Start no new command; give pending ones up to ``settle_s`` to be acknowledged, then cancel them
        (they stay unresolved in the ledger: sent, maybe stored, never acknowledged)."""
        self._stopping.set()
        pending: set[asyncio.Task[None]] = set()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=settle_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _writer(self, w: int, rng: random.Random) -> None:
        n = 0
        while not self._stopping.is_set():
            n += 1
            command = self._draw(f"{self.tag}-w{w}-{n}", rng)
            self.ledger.sent[command.id] = command
            backoff = 0.02
            while True:
                started = time.monotonic()
                try:
                    acked = await self.run_command(command)
                except Exception as exc:  # counted by type (the checker judges them), then resent with the same id
                    self.ledger.error(exc)
                    self.ledger.slowest_call_s = max(self.ledger.slowest_call_s, time.monotonic() - started)
                    await asyncio.sleep(rng.uniform(backoff / 2, backoff))
                    backoff = min(backoff * 2, self.max_backoff_s)
                    continue
                self.ledger.slowest_call_s = max(self.ledger.slowest_call_s, time.monotonic() - started)
                self.ledger.acked[command.id] = acked
                self.ledger.acked_at[command.id] = time.monotonic()
                break
            if self.pause_s:
                await asyncio.sleep(rng.uniform(0, 2 * self.pause_s))

    def _draw(self, command_id: str, rng: random.Random) -> Command:
        kind = rng.choice(self.kinds)
        if kind == "entities":
            chosen = rng.sample(self.ids, rng.randint(2, max(2, self.max_entities)))
            return Command(command_id, kind, {e: rng.randint(1, 2) for e in chosen})
        return Command(command_id, kind, {rng.choice(self.ids): rng.randint(2, max(2, self.max_events))})

    def _events(self, command: Command, entity: str) -> list[Step]:
        entities = sorted(command.parts)
        parts = command.parts[entity]
        return [Step(command=command.id, part=p, parts=parts, entities=entities) for p in range(parts)]

    async def run_command(self, command: Command) -> dict[str, tuple[int, int]]:
        """Send the command once; (position, last version) per entity as acknowledged."""
        if command.kind == "command":
            (entity, parts), = command.parts.items()
            result = await self.repository.execute(
                entity, lambda tally: tally.step(command.id, parts), create=True, exist_ok=True, command_id=command.id
            )
            self.ledger.duplicate_acks += result.duplicate
            return {entity: (result.position, result.version)}
        requests = [EntityAppend(StreamId(CATEGORY, e), self._events(command, e), ANY) for e in command.parts]
        if command.kind == "events":
            results = [await self.store.append(
                requests[0].stream_id, requests[0].events, ANY, idempotency_key=command.id
            )]
        else:
            results = await self.store.append_many(requests, idempotency_key=command.id)
        self.ledger.duplicate_acks += results[0].duplicate
        return {r.stream_id.entity_id: (r.position, r.last_version) for r in results}


@dataclass
class Report:
    """The checker's findings. ``lost``: acknowledged commands not (wholly) stored; ``duplicated``: events stored
    more than once; ``partial_commands``: commands stored in part; ``gaps``: entities whose versions are not
    1..n in order; ``misreported``: acknowledgements whose position or version differs from what is stored."""

    acked: int = 0
    stored: int = 0
    stored_events: int = 0
    unresolved: int = 0
    unresolved_stored: int = 0
    lost: int = 0
    duplicated: int = 0
    partial_commands: int = 0
    gaps: int = 0
    misreported: int = 0
    errors_by_type: dict[str, int] = field(default_factory=dict)
    reads: int = 0  # reads checked while writers ran (kill_clients)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "problems"}

    @property
    def unexpected_errors(self) -> dict[str, int]:
        return {k: v for k, v in self.errors_by_type.items() if k not in EXPECTED_ERRORS}

    def assert_clean(self, *, expected_errors: frozenset[str] = EXPECTED_ERRORS) -> None:
        """Fail (AssertionError with the first problems) unless nothing was lost, duplicated, partial or gapped,
        every acknowledgement matches the store, and every error is of an expected type."""
        unexpected = {k: v for k, v in self.errors_by_type.items() if k not in expected_errors}
        bad = {k: getattr(self, k) for k in ("lost", "duplicated", "partial_commands", "gaps", "misreported")}
        assert not any(bad.values()) and not unexpected, (
            f"{bad}, unexpected errors {unexpected}; first problems: {self.problems[:10]}; report {self.as_dict()}"
        )


def check_events(events: list[RecordedEvent], report: Report | None = None) -> tuple[Report, dict[str, dict[str, tuple[int, int]]]]:
    """Check the workload's events (in stream order) on their own: no duplicate, no partial command, no gap.

    Returns the report and, per stored command, (position, last version) per entity. Usable on a prefix of the
    stream read while writers run (a reader concurrent with an atomic batch must never see part of it).
    """
    report = report or Report()
    versions: dict[str, list[int]] = defaultdict(list)
    seen: dict[str, dict[str, dict[int, int]]] = defaultdict(lambda: defaultdict(dict))  # cmd -> entity -> part -> n
    declared: dict[str, tuple[frozenset[str], dict[str, int]]] = {}
    stored: dict[str, dict[str, tuple[int, int]]] = defaultdict(dict)
    for event in events:
        entity = event.stream_id.entity_id
        versions[entity].append(event.version)
        data = json.loads(event.payload)
        command, part, parts = data["command"], data["part"], data["parts"]
        counts = seen[command][entity]
        counts[part] = counts.get(part, 0) + 1
        if counts[part] > 1:
            report.duplicated += 1
            report.problems.append(f"{command}: part {part} on {entity} stored {counts[part]} times")
        declared.setdefault(command, (frozenset(data["entities"]), {}))[1][entity] = parts
        position, last = stored[command].get(entity, (event.position, 0))
        if position != event.position:
            report.problems.append(f"{command}: its events on {entity} are in two commits ({position}, {event.position})")
            report.duplicated += 1
        stored[command][entity] = (position, max(last, event.version))
    for command, by_entity in seen.items():
        entities, parts = declared[command]
        whole = set(by_entity) == entities and all(set(by_entity[e]) == set(range(parts[e])) for e in by_entity)
        if not whole:
            report.partial_commands += 1
            report.problems.append(f"{command}: partial, stored {dict((e, sorted(p)) for e, p in by_entity.items())} "
                                   f"of entities {sorted(entities)}")
    for entity, seq in versions.items():
        if seq != list(range(1, len(seq) + 1)):
            report.gaps += 1
            report.problems.append(f"{entity}: versions {seq[:20]}... are not 1..{len(seq)}")
    report.stored = len(seen)
    report.stored_events = len(events)
    return report, stored


async def read_model_equals_rebuild(settings: ProjectionSettings, es: EventStore, database: Path) -> None:
    """Assert that :class:`StepCounts`'s read model in ``settings.database`` equals a clean replay of the whole
    stream into a new database at ``database`` (run in burst mode, the daemon's own code path)."""
    with SqliteStore(settings.database) as store:
        followed = store.dump(StepCounts.name)
    fresh = settings.model_copy(update={"database": database})
    async with asyncio.timeout(120):
        outcomes = await Daemon([StepCounts()], fresh, event_store=es).run(until_caught_up=True)
    assert outcomes == {StepCounts.name: Outcome.CAUGHT_UP}, outcomes
    with SqliteStore(database) as store:
        rebuilt = store.dump(StepCounts.name)
    assert followed == rebuilt


def projection_checkpoint(settings: ProjectionSettings, name: str = StepCounts.name) -> int:
    """The live generation's checkpoint of projection ``name`` (0 before its first run)."""
    with SqliteStore(settings.database) as store:
        live = store.live_generation(name)
        return live.checkpoint if live else 0


async def kill_server(server: EmbeddedServer, ledger: Ledger, *, down_s: float, resume_timeout_s: float = 30.0) -> dict[str, float]:
    """SIGKILL ``server`` while writers run, keep it down ``down_s``, restart it on the same storage and wait for the
    first acknowledgement after. ``outage_s``: from the kill to that acknowledgement (what writers lived through);
    ``recovery_s``: from the server being back to it. Raises AssertionError if nothing is acknowledged in time."""
    server.kill()
    killed = time.monotonic()
    await asyncio.sleep(down_s)
    server.start()
    back = time.monotonic()
    while (first := ledger.first_ack_after(back)) is None:
        assert time.monotonic() - back < resume_timeout_s, f"no append acknowledged {resume_timeout_s}s after the restart"
        await asyncio.sleep(0.01)
    return {"outage_s": first - killed, "recovery_s": first - back, "killed": killed, "back": back}


async def read_workload_events(store: EventStore, timeout_s: float = 60.0) -> list[RecordedEvent]:
    """Every workload event in the store, in stream order."""
    events: list[RecordedEvent] = []
    async with asyncio.timeout(timeout_s):
        async for batch in store.read_all(categories=[CATEGORY]):
            events.extend(batch)
    return events


async def check(store: EventStore, ledger: Ledger) -> Report:
    """Read the whole workload back and compare it with ``ledger`` (see :class:`Report`)."""
    events = await read_workload_events(store)
    report, stored = check_events(events)
    report.acked = len(ledger.acked)
    report.errors_by_type = dict(ledger.errors)
    by_position = {e.position: e for e in events}
    for command_id, acked in ledger.acked.items():
        found = stored.get(command_id)
        if found is None or set(found) != set(acked):
            report.lost += 1
            there = {p: (by_position[p].stream_id.entity_id, json.loads(by_position[p].payload)["command"])
                     for p, _ in acked.values() if p in by_position}
            report.problems.append(f"{command_id} ({ledger.sent[command_id].kind}): acknowledged {acked}, stored "
                                   f"{found}; at the acknowledged positions: {there}")
        elif found != acked:
            report.misreported += 1
            report.problems.append(f"{command_id}: acknowledged {acked}, stored {found}")
    unresolved = set(ledger.sent) - set(ledger.acked)
    report.unresolved = len(unresolved)
    report.unresolved_stored = len(unresolved & set(stored))
    unknown = set(stored) - set(ledger.sent)
    if unknown and ledger.sent:
        report.problems.append(f"stored commands nobody sent: {sorted(unknown)[:5]}")
        report.duplicated += len(unknown)
    return report


# -- a client killed mid-batch: the child process -------------------------------------------------------------


def client_kill_child_argv(nats_url: str, stream: str, subject_prefix: str, acked_file: Path, *, entities: int,
                           per_batch: int, seed: int) -> list[str]:
    """argv of a child process that loops ``append_many`` over ``per_batch`` of ``entities`` entities (one or two
    events each) until killed, appending each acknowledged command id to ``acked_file`` (run it with the
    repository root on PYTHONPATH)."""
    return [sys.executable, "-m", "tests.support.workload", nats_url, stream, subject_prefix, str(acked_file),
            str(entities), str(per_batch), str(seed)]


async def _append_many_forever(nats_url: str, stream: str, subject_prefix: str, acked_file: Path, entities: int,
                               per_batch: int, seed: int) -> None:
    settings = EventStoreSettings(nats_url=nats_url, stream=stream, subject_prefix=subject_prefix)
    async with EventStore.connect(settings) as store:
        workload = Workload(store, entities=entities, writers=0, max_entities=per_batch, seed=seed)
        rng = random.Random(seed)
        with open(acked_file, "a", buffering=1) as acked:
            n = 0
            while True:
                n += 1
                command = Command(f"{workload.tag}-{n}", "entities",
                                  {e: rng.randint(1, 2) for e in rng.sample(workload.ids, per_batch)})
                await workload.run_command(command)
                acked.write(command.id + "\n")


async def kill_clients(
    store: EventStore,
    acked_file: Path,
    *,
    kills: int,
    entities: int = 600,
    per_batch: tuple[int, int] = (200, 400),
    seed: int = 0,
    max_wait_s: float = 20.0,
) -> Report:
    """SIGKILL ``kills`` child processes (:func:`client_kill_child_argv`), each once it has had two more batches
    acknowledged, at a random moment after, while a reader checks the stream over and over; then read back.

    The report counts every problem any read (concurrent or final) found: ``partial_commands``, ``duplicated``,
    ``gaps``; ``lost`` is acknowledged batches not stored; ``acked`` and ``stored`` are from the final read;
    ``reads`` counts the concurrent reads. Raises AssertionError if a child dies by itself or stalls.
    """
    rng = random.Random(seed)
    settings = store.settings
    result = Report()
    stop = asyncio.Event()

    def note(found: Report) -> None:
        result.partial_commands += found.partial_commands
        result.duplicated += found.duplicated
        result.gaps += found.gaps
        result.problems.extend(found.problems)

    async def read_while_it_runs() -> None:
        while not stop.is_set():
            note(check_events(await read_workload_events(store))[0])
            result.reads += 1

    def acked_count() -> int:
        return len(acked_file.read_text().split()) if acked_file.exists() else 0

    stored: dict[str, dict[str, tuple[int, int]]] = {}
    for kill in range(kills):
        argv = client_kill_child_argv(str(settings.nats_url), settings.stream, settings.subject_prefix, acked_file,
                                      entities=entities, per_batch=rng.randint(*per_batch), seed=seed * 1000 + kill)
        child = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE)
        stop.clear()
        reader = asyncio.create_task(read_while_it_runs())
        try:
            before = acked_count()
            deadline = time.monotonic() + max_wait_s
            while acked_count() < before + 2 and child.poll() is None:
                assert time.monotonic() < deadline, f"the child appended nothing in {max_wait_s}s"
                await asyncio.sleep(0.02)
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            assert child.poll() is None, child.stderr.read().decode() if child.stderr else "the child died"
        finally:
            child.kill()
            await asyncio.to_thread(child.wait)
            stop.set()
            await reader
        final, stored = check_events(await read_workload_events(store))
        note(final)
    acked = set(acked_file.read_text().split()) if acked_file.exists() else set()
    result.acked, result.stored = len(acked), len(stored)
    result.lost = len(acked - set(stored))
    return result


if __name__ == "__main__":
    _url, _stream, _prefix, _file, _entities, _per_batch, _seed = sys.argv[1:]
    asyncio.run(_append_many_forever(_url, _stream, _prefix, Path(_file), int(_entities), int(_per_batch), int(_seed)))

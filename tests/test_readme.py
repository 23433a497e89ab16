"""The README's Python blocks run as written, in order, against the session's server.

Blocks fenced as ``py`` rather than ``python`` (the Spark example: its classes would have
to be importable by Spark's executors) are exercised by the samples and their tests instead.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from eventstore import EventStore
from tests.support.postgres import unique_schema

README = Path(__file__).resolve().parents[1] / "README.md"


async def test_readme_python_blocks_run_in_order(
    store: EventStore, monkeypatch: pytest.MonkeyPatch, postgres_url: str
) -> None:
    # The first block connects with the defaults: point them at this test's server and stream.
    monkeypatch.setenv("NATS_URL", store.settings.nats_url or "")
    monkeypatch.setenv("JETSOURCING_DATABASE", postgres_url)  # the read models' block says PostgreSQL
    monkeypatch.setenv("JETSOURCING_POSTGRES_SCHEMA", unique_schema())
    monkeypatch.setenv("JETSOURCING_LEASE_BUCKET", f"readme_{unique_schema()}")
    monkeypatch.setenv("JETSOURCING_STREAM", store.settings.stream + "R")
    monkeypatch.setenv("JETSOURCING_SUBJECT_PREFIX", store.settings.subject_prefix + "r")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3
    namespace: dict[str, object] = {"store": store}
    for number, block in enumerate(blocks, start=1):
        source = "async def _block():\n" + textwrap.indent(block, "    ") + "\n    return locals()\n"
        exec(compile(source, f"README.md python block {number}", "exec"), namespace)
        results = await namespace["_block"]()  # type: ignore[operator]
        results.pop("store", None)  # the first block's own store is closed by its `async with`
        namespace.update(results)
    alice = namespace["alice"]
    assert alice.state.balance == 10 and alice.version == 2  # type: ignore[attr-defined]
    assert namespace["result"].duplicate is False  # type: ignore[attr-defined]
    assert len(str(namespace["carol"])) == 36  # a new_id()
    assert len(str(namespace["fay"])) == 36  # opened in the in-memory store
    reply = namespace["reply"]  # the deposit sent over NATS to the README's command service
    assert (reply.version, reply.duplicate, reply.command_id) == (3, False, "dep-2")  # type: ignore[attr-defined]
    assert namespace["refusal"] == "Deposit a positive amount."
    assert type(namespace["views"]).__name__ == "PostgresStore"
    # Opened, 10 deposited in-process, 5 over NATS: the daemon's PostgreSQL read model has it all.
    assert namespace["alice_row"] == {"account_id": "alice", "owner": "Alice", "balance": 15}
    assert namespace["rich"] == [namespace["alice_row"]]

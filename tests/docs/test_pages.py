"""The documentation's Python blocks run as written, in the order a reader meets them, against the session's server.

The pages continue one another's examples (the aggregates page uses the event store page's
``store``, the projections page the aggregates page's events), so they run in one namespace.
Blocks fenced as ``py`` rather than ``python`` (the Spark examples: their classes would have
to be importable by Spark's executors) are run by the Spark tests instead.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from eventstore import EventStore
from tests.support.postgres import unique_schema

DOCS = Path(__file__).resolve().parents[2] / "docs"
# The pages whose ``python`` blocks make one story, in the order they build on each other.
STORY = (
    "concepts/event-store.md",
    "guides/clusters.md",
    "concepts/aggregates.md",
    "concepts/commands.md",
    "concepts/projections.md",
    "guides/postgresql.md",
)


def test_every_page_with_python_blocks_is_run() -> None:
    """A page that gains a ``python`` block must join the story (or fence it ``py`` and have its own test).

    A block that only includes a file (``--8<-- "path"``) shows code the tests run from that file.
    """
    with_blocks = {
        str(page.relative_to(DOCS))
        for page in DOCS.rglob("*.md")
        if any(not block.startswith("--8<--") for block in python_blocks(page))
    }
    assert with_blocks == set(STORY)


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


async def test_the_pages_python_blocks_run_in_order(
    store: EventStore, monkeypatch: pytest.MonkeyPatch, postgres_url: str
) -> None:
    # The first block connects with the defaults: point them at this test's server and stream.
    monkeypatch.setenv("NATS_URL", store.settings.nats_url or "")
    monkeypatch.setenv("JETSOURCING_DATABASE", postgres_url)  # the read models' block says PostgreSQL
    monkeypatch.setenv("JETSOURCING_POSTGRES_SCHEMA", unique_schema())
    monkeypatch.setenv("JETSOURCING_LEASE_BUCKET", f"readme_{unique_schema()}")
    monkeypatch.setenv("JETSOURCING_STREAM", store.settings.stream + "R")
    monkeypatch.setenv("JETSOURCING_SUBJECT_PREFIX", store.settings.subject_prefix + "r")
    blocks = [
        (f"docs/{page} python block {number}", block)
        for page in STORY
        for number, block in enumerate(python_blocks(DOCS / page), start=1)
    ]
    assert len(blocks) >= 7
    namespace: dict[str, object] = {"store": store}
    for where, block in blocks:
        source = "async def _block():\n" + textwrap.indent(block, "    ") + "\n    return locals()\n"
        exec(compile(source, where, "exec"), namespace)
        results = await namespace["_block"]()  # type: ignore[operator]
        results.pop("store", None)  # the first block's own store is closed by its `async with`
        namespace.update(results)
    alice = namespace["alice"]
    assert alice.state.balance == 10 and alice.version == 2  # type: ignore[attr-defined]
    assert namespace["result"].duplicate is False  # type: ignore[attr-defined]
    assert len(str(namespace["carol"])) == 36  # a new_id()
    assert len(str(namespace["fay"])) == 36  # opened in the in-memory store
    reply = namespace["reply"]  # the deposit sent over NATS to the commands page's service
    assert (reply.version, reply.duplicate, reply.command_id) == (3, False, "dep-2")  # type: ignore[attr-defined]
    assert namespace["refusal"] == "Deposit a positive amount."
    assert type(namespace["views"]).__name__ == "PostgresStore"
    # Opened, 10 deposited in-process, 5 over NATS: the daemon's PostgreSQL read model has it all.
    assert namespace["alice_row"] == {"account_id": "alice", "owner": "Alice", "balance": 15}
    assert namespace["rich"] == [namespace["alice_row"]]

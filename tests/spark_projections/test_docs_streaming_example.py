"""The Spark page's streaming example (docs/concepts/spark.md) runs as written: the ``py`` block that starts with ``# streaming example``."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from eventstore import EventStore
from spark_projections import follow_status, rebuild

from test_projection import history, shipped  # noqa: F401 - executors import the examples
from test_follow import delta_rs_rows
from projection_examples import AccountBalances, workload

PAGE = Path(__file__).resolve().parents[2] / "docs" / "concepts" / "spark.md"  # the Spark projections page


def streaming_block() -> str:
    [block] = re.findall(r"```py\n(# streaming example.*?)```", PAGE.read_text(), flags=re.S)
    return block


async def test_the_docs_streaming_example_follows_the_stream(
    spark: SparkSession, store: EventStore, tmp_path: Path, monkeypatch: Any
) -> None:
    await history(store, workload(200, 10, seed=41))
    monkeypatch.chdir(tmp_path)  # the example writes lake/accounts under the working directory
    source = streaming_block()

    async def appended_meanwhile() -> None:
        """What the example's `...` stands for: appends, then the time they take to land."""
        last = await history(store, workload(60, 10, seed=42))
        deadline = time.monotonic() + 180
        while (follow_status("lake/accounts", AccountBalances()) or _Nothing).position != last:
            assert time.monotonic() < deadline, "the follower did not catch up"
            await asyncio.sleep(0.2)

    before, after = source.split("...", 1)
    namespace: dict[str, Any] = {"settings": store.settings, "AccountBalances": AccountBalances}
    exec(compile(before, "docs/concepts/spark.md streaming example", "exec"), namespace)
    await appended_meanwhile()
    exec(compile(after, "docs/concepts/spark.md streaming example", "exec"), namespace)
    rebuilt = tmp_path / "rebuilt"
    rebuild(spark, AccountBalances(), store.settings, rebuilt)
    assert delta_rs_rows(tmp_path / "lake" / "accounts", AccountBalances()) == delta_rs_rows(rebuilt, AccountBalances())
    assert namespace["events"].isStreaming


class _Nothing:
    position = 0

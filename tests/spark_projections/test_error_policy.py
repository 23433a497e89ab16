"""Handler errors in Spark follow the daemon's error policy: ``stop`` names the event and writes nothing,
``dead_letter`` records the failing commit in a Delta table and applies the rest as the daemon does."""

from __future__ import annotations

from pathlib import Path

import deltalake
import pytest
from pyspark.sql import SparkSession

from eventstore import EventStore, StreamId
from spark_projections import DEAD_LETTERS_TABLE, HandlerFailedError, SparkProjectionError, rebuild, update

from test_projection import daemon_read_model, history, shipped  # noqa: F401 - executors import the examples
from test_follow import delta_rs_rows
from projection_examples import AccountOpened, Corrupted, Deposited, FragileBalances, workload


def dead_letters(root: Path) -> list[tuple[int, int, str, str]]:
    rows = deltalake.DeltaTable(str(root / DEAD_LETTERS_TABLE)).to_pyarrow_table().to_pylist()
    return sorted((r["position"], r["index"], r["stream_id"], r["event_type"]) for r in rows)


async def test_stop_names_the_earliest_failing_event_and_writes_nothing(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    await history(store, workload(120, 6, seed=31))
    first = await store.append(StreamId("Account", "poison-1"), [AccountOpened(owner="p"), Corrupted(detail="x")])
    await store.append(StreamId("Account", "poison-2"), [Corrupted(detail="y")])
    with pytest.raises(HandlerFailedError) as failed:
        rebuild(spark, FragileBalances(), store.settings, tmp_path / "stop", error_policy="stop")
    error = failed.value
    assert (error.position, error.index, error.event_type, error.stream_id) == (
        first.position, 1, "Corrupted", "Account/poison-1")
    assert error.failures == 2 and "ValueError: cannot apply" in error.error and "Traceback" in error.traceback
    assert "dead_letter" in str(error)  # says what to do
    assert not (tmp_path / "stop").exists()  # nothing written
    # The projection's own policy (stop) is the default.
    with pytest.raises(HandlerFailedError):
        rebuild(spark, FragileBalances(), store.settings, tmp_path / "default")


async def test_dead_letter_skips_whole_commits_and_equals_the_daemon_in_rebuild_and_update(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    appends = workload(200, 8, seed=32)
    await history(store, appends[:100])
    # The commit's first event alone would open the account: a dead-lettered commit leaves no rows behind.
    first = await store.append(StreamId("Account", "poison-1"), [AccountOpened(owner="p"), Corrupted(detail="x")])
    root = tmp_path / "dl"
    projection = FragileBalances()
    rebuild(spark, projection, store.settings, root, error_policy="dead_letter")
    assert dead_letters(root) == [(first.position, 1, "Account/poison-1", "Corrupted")]
    assert delta_rs_rows(root, projection) == await daemon_read_model(store, projection, tmp_path, "dead_letter")

    await history(store, appends[100:])
    second = await store.append(StreamId("Account", "poison-2"), [Corrupted(detail="y")])
    await store.append(StreamId("Account", "poison-1"), [Deposited(amount=5)])  # its account never opened
    run = update(spark, projection, store.settings, root, error_policy="dead_letter")
    assert run.mode == "merge"
    assert dead_letters(root) == [(first.position, 1, "Account/poison-1", "Corrupted"),
                                  (second.position, 0, "Account/poison-2", "Corrupted")]
    assert delta_rs_rows(root, projection) == await daemon_read_model(store, projection, tmp_path, "dead_letter")
    # A rebuild replaces the dead letters with its own: the same ones.
    rebuilt = tmp_path / "rebuilt"
    rebuild(spark, projection, store.settings, rebuilt, error_policy="dead_letter")
    assert dead_letters(rebuilt) == dead_letters(root)


async def test_an_unknown_error_policy_is_refused(spark: SparkSession, store: EventStore, tmp_path: Path) -> None:
    await history(store, workload(10, 2, seed=33))
    with pytest.raises(SparkProjectionError, match="Unknown error policy 'skip': use 'stop' or 'dead_letter'"):
        rebuild(spark, FragileBalances(), store.settings, tmp_path / "x", error_policy="skip")

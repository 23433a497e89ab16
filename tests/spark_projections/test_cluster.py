"""Spark with executors of their own: ``local-cluster[2,1,1024]`` runs two executor JVMs, each with its own Python
workers, as a cluster's hosts would. A projection from the user's own module, which is not installed, rebuilds and
updates there because jetsourcing ships the module; without shipping the executors cannot import it. The tables
equal those of the test session's ``local[2]`` (read with delta-rs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import deltalake
from pyspark.sql import SparkSession

from eventstore import EventStore
from spark_projections import rebuild

CLUSTER = Path(__file__).with_name("cluster")


def rows(path: Path) -> list[dict[str, Any]]:
    table = deltalake.DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    return sorted(({k: v for k, v in r.items() if not k.startswith("_jetsourcing")} for r in table),
                  key=lambda r: r["wallet"])


def user_module(folder: Path) -> ModuleType:
    """``wallet_views`` copied to ``folder`` and imported from there, as a user's own module would be."""
    shutil.copy(CLUSTER / "wallet_views.py", folder / "wallet_views.py")
    sys.modules.pop("wallet_views", None)
    sys.path.insert(0, str(folder))
    try:
        import wallet_views
    finally:
        sys.path.remove(str(folder))
    return wallet_views


async def test_a_projection_in_an_uninstalled_module_rebuilds_and_updates_on_separate_executors(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    code = tmp_path / "app"
    code.mkdir()
    views = user_module(code)
    shutil.copy(CLUSTER / "cluster_run.py", code / "cluster_run.py")
    await views.append(store.settings, 0, 300)

    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_") and k != "PYTHONPATH"}
    env.update({"NATS_URL": store.settings.nats_url or "", "JETSOURCING_STREAM": store.settings.stream,
                "JETSOURCING_SUBJECT_PREFIX": store.settings.subject_prefix})
    cluster = tmp_path / "cluster"
    done = subprocess.run([sys.executable, "cluster_run.py", "local-cluster[2,1,1024]", str(cluster)], cwd=code,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["master"] == "local-cluster[2,1,1024]"
    assert out["unshipped"] == "ModuleNotFoundError", out  # the executors have only what is shipped
    last = await store.last_position()
    assert out["runs"] == [["rebuild", 300], ["rebuild", 300], ["merge", last], ["merge", last]]

    # The same projections in this session's local[2], from the same uninstalled module (shipped here too).
    local = tmp_path / "local"
    for projection in (views.Balances(), views.PAYMENTS):
        rebuild(spark, projection, store.settings, local)
    assert rows(cluster / "balances") == rows(local / "balances")
    assert rows(cluster / "lc_payments") == rows(local / "lc_payments")
    payments = rows(local / "lc_payments")
    assert len(payments) == 20 and sum(r["payments"] for r in payments) == 340
    assert sum(r["total"] for r in payments) == sum(range(20, 360))

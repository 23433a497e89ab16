"""Spark with executors of their own, started as the Spark cluster guide (docs/guides/spark-cluster.md) says: its ``spark-submit`` line, with the master
``local-cluster[2,1,1024]`` (two executor JVMs, each with its own Python workers, as a cluster's hosts would have).

The driver program (``cluster/cluster_run.py``) runs the guide's ``rebuild_accounts.py`` and more. A projection from
the user's own module, which is not installed, rebuilds, updates and follows there because jetsourcing ships the
module; without shipping, the run fails with an error naming the module. The preflight finds a credentials file and
a ``local:`` jar missing on the executors. The tables equal those of the test session's ``local[2]`` (read with
delta-rs)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import deltalake
import pytest
from pyspark.sql import SparkSession

from eventstore import EventStore
from spark_projections import rebuild
from spark_projections.jars import delta_coordinate
from spark_projections.settings import DELTA_MAVEN_VERSION

CLUSTER = Path(__file__).with_name("cluster")
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "spark-cluster.md"  # the Spark cluster guide
MASTER = "local-cluster[2,1,1024]"


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


def readme_submit(nats_url: str, root: Path) -> tuple[dict[str, str], list[str]]:
    """The guide's spark-submit line (its environment and its command), for this machine: the master, the NATS URL
    and the Python replaced, and ``cluster_run.py <root>`` as the program."""
    text = GUIDE.read_text()
    [line] = re.findall(r"```sh\n(NATS_URL=\S+ PYSPARK_PYTHON=\S+ spark-submit .*?)```", text, flags=re.S)
    words = shlex.split(line.replace("\\\n", " "), comments=True)
    env = dict(word.split("=", 1) for word in words[: words.index("spark-submit")])
    assert set(env) == {"NATS_URL", "PYSPARK_PYTHON"}
    command = words[words.index("spark-submit"):]
    assert command[command.index("--packages") + 1] == delta_coordinate(DELTA_MAVEN_VERSION)  # the Delta we use
    assert command[-2:] == ["rebuild_accounts.py", "/shared/lake/accounts"]
    command[command.index("--master") + 1] = MASTER
    command[0] = str(Path(sys.executable).parent / "spark-submit")
    return {"NATS_URL": nats_url, "PYSPARK_PYTHON": sys.executable}, [*command[:-2], "cluster_run.py", str(root)]


def readme_program() -> str:
    [program] = re.findall(r"```py\n(# rebuild_accounts\.py\n.*?)```", GUIDE.read_text(), flags=re.S)
    return program


@pytest.mark.timeout(900)  # two executor JVMs and a driver on 2 cores: over 5 minutes when the machine is loaded
async def test_the_guides_spark_submit_line_runs_an_uninstalled_projection_on_separate_executors(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    code = tmp_path / "app"
    (code / "myapp").mkdir(parents=True)
    views = user_module(code)
    shutil.copy(CLUSTER / "cluster_run.py", code / "cluster_run.py")
    (code / "rebuild_accounts.py").write_text(readme_program())
    (code / "myapp" / "__init__.py").write_text("")
    (code / "myapp" / "views.py").write_text("from wallet_views import Balances as AccountBalances\n")
    await views.append(store.settings, 0, 300)

    cluster = tmp_path / "cluster"
    readme_env, command = readme_submit(store.settings.nats_url or "", cluster)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JETSOURCING_", "PYSPARK_GATEWAY_")) and k != "PYTHONPATH"}
    env.update(readme_env)
    env.update({"JETSOURCING_STREAM": store.settings.stream, "JETSOURCING_SUBJECT_PREFIX": store.settings.subject_prefix})
    # In a thread: the run takes minutes, and a blocked event loop would leave the store's connection unanswered
    # to the server's PINGs until the server drops it as stale.
    done = await asyncio.to_thread(
        subprocess.run, command, cwd=code, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["master"] == MASTER
    assert "credentials_file app.creds (a relative path, looked up from each executor's working directory" \
        in out["relative_creds"], out
    assert out["absolute_creds"] == "not refused"
    assert "the local: jar jars/delta-extra.jar (a relative path" in out["local_jar"], out
    assert "cannot import 'wallet_views' (ModuleNotFoundError): shipping the projection's code to the executors " \
        "is off" in out["unshipped"], out  # the executors have only what is shipped
    last = await store.last_position()
    assert out["runs"] == [["noop", 300], ["rebuild", 300], ["merge", last], ["merge", last]]
    assert out["followed"] == last

    # The same projections in this session's local[2], from the same uninstalled module (shipped here too).
    local = tmp_path / "local"
    for projection in (views.Balances(), views.PAYMENTS):
        rebuild(spark, projection, store.settings, local)
    assert rows(cluster / "balances") == rows(local / "balances") == rows(cluster / "followed" / "balances")
    assert rows(cluster / "lc_payments") == rows(local / "lc_payments")
    payments = rows(local / "lc_payments")
    assert len(payments) == 20 and sum(r["payments"] for r in payments) == 340
    assert sum(r["total"] for r in payments) == sum(range(20, 360))

"""The cluster test's driver program, run with the guide's ``spark-submit`` line: ``spark-submit ... cluster_run.py
<root>`` next to ``wallet_views.py`` and the guide's ``rebuild_accounts.py``, with ``NATS_URL``,
``JETSOURCING_STREAM`` and ``JETSOURCING_SUBJECT_PREFIX`` set; prints one JSON object as its last line.

As the guide says of a program under ``spark-submit``, it takes the session spark-submit configured. First the
preflight: a relative credentials path, a ``local:`` jar missing on the executors, and a rebuild with shipping off
(the executors cannot import ``wallet_views``), each refused with an ExecutorSetupError. Then, with shipping on (the
default), the guide's program rebuilds the fold (``myapp.views.AccountBalances`` is ``wallet_views.Balances``), the
DataFrame projection rebuilds, both update over 60 more events, and the fold follows the stream into tables of its
own, with nothing put on any PYTHONPATH."""

from __future__ import annotations

import asyncio
import json
import runpy
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from eventstore import EventStoreSettings
from spark_projections import follow, read_events, rebuild, update
from spark_projections.errors import ExecutorSetupError
from spark_projections.executors import check_executor_files, check_executor_jars
from spark_projections.ship import SHIP_CODE_CONF
from spark_projections.source import register

import wallet_views
from wallet_views import PAYMENTS, Balances, append


def refused(check: object, *args: object) -> str:
    """The ExecutorSetupError ``check(*args)`` raises, as text; anything else is a failure of the test."""
    try:
        check(*args)  # type: ignore[operator]
    except ExecutorSetupError as exc:
        return str(exc)
    return "not refused"


def main(root: str) -> None:
    spark = SparkSession.builder.getOrCreate()
    register(spark)
    settings = EventStoreSettings()
    out: dict[str, object] = {"master": spark.sparkContext.master}

    # Next to this program the file exists; from the executors' working directories it does not.
    Path("app.creds").write_text(
        "-----BEGIN NATS USER JWT-----\nx\n------END NATS USER JWT------\n-----BEGIN USER NKEY SEED-----\nSU\n")
    relative = settings.model_copy(update={"credentials_file": Path("app.creds")})
    out["relative_creds"] = refused(read_events, spark, relative)  # before anything connects
    out["absolute_creds"] = refused(check_executor_files, spark, relative.model_copy(
        update={"credentials_file": Path("app.creds").absolute()}))
    out["local_jar"] = refused(check_executor_jars, spark, ["jars/delta-extra.jar"])

    spark.conf.set(SHIP_CODE_CONF, "false")
    out["unshipped"] = refused(rebuild, spark, Balances(), settings, f"{root}/unshipped")
    spark.conf.set(SHIP_CODE_CONF, "true")

    sys.argv = ["rebuild_accounts.py", root]
    runpy.run_path("rebuild_accounts.py", run_name="__main__")
    runs = [rebuild(spark, p, settings, root) for p in (Balances(), PAYMENTS)]  # Balances: already there
    asyncio.run(append(settings, 300, 60))
    runs += [update(spark, p, settings, root) for p in (Balances(), PAYMENTS)]
    follower = follow(spark, Balances(), settings, f"{root}/followed", available_now=True)
    follower.await_termination(300)
    out["followed"] = follower.status.position if follower.status is not None else repr(follower.error)
    out["runs"] = [(r.mode, r.position) for r in runs]
    out["module"] = wallet_views.__file__
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])

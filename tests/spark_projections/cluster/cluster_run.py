"""The cluster test's driver program: run as ``python cluster_run.py <master>`` next to ``wallet_views.py``, with
``NATS_URL``, ``JETSOURCING_STREAM`` and ``JETSOURCING_SUBJECT_PREFIX`` set; prints one JSON object.

With shipping off, a rebuild fails in the executors (they cannot import ``wallet_views``); with it on (the
default), both projections rebuild, then update over 60 more events, with nothing put on any PYTHONPATH."""

from __future__ import annotations

import asyncio
import json
import sys

from eventstore import EventStoreSettings
from spark_projections import SparkSettings, rebuild, spark_session, update
from spark_projections.ship import SHIP_CODE_CONF

import wallet_views
from wallet_views import PAYMENTS, Balances, append


def main(master: str, root: str) -> None:
    settings = EventStoreSettings()
    spark = spark_session(SparkSettings(master=master, shuffle_partitions=2, app_name="jetsourcing-cluster-test"))
    out: dict[str, object] = {"master": spark.sparkContext.master}
    spark.conf.set(SHIP_CODE_CONF, "false")
    try:
        rebuild(spark, Balances(), settings, f"{root}/unshipped")
        out["unshipped"] = "rebuilt"
    except Exception as exc:  # the executors' error, as Spark hands it over
        out["unshipped"] = "ModuleNotFoundError" if "No module named 'wallet_views'" in str(exc) else repr(exc)[:500]
    spark.conf.set(SHIP_CODE_CONF, "true")
    runs = [rebuild(spark, p, settings, root) for p in (Balances(), PAYMENTS)]
    asyncio.run(append(settings, 300, 60))
    runs += [update(spark, p, settings, root) for p in (Balances(), PAYMENTS)]
    out["runs"] = [(r.mode, r.position) for r in runs]
    out["module"] = wallet_views.__file__
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

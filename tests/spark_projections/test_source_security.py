"""The ``jetstream`` data source on a secured server: mutual TLS plus a password, through real Spark.

The shared ``spark`` fixture's executors (local[2]) read the same certificate files as
the driver, as a cluster's executors would from a path present on every node.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from collections.abc import Iterator

import pytest
from pydantic import BaseModel
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from eventstore import EmbeddedServer, EventStore, EventStoreSettings, StreamId
from spark_projections import _options, source
from spark_projections.source import EventSourceError
from spark_projections.source import read_events
from tests.secured import HOSTNAME, Pki, make_pki

PASSWORD = "spark-s3cret"


class Deposited(BaseModel):
    amount: int


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[EmbeddedServer]:
    """Mutual TLS (a client certificate signed by the CA) and a user with a password."""
    extra = pki.tls_block(verify_clients=True) + f'authorization {{ user: spark, password: "{PASSWORD}" }}\n'
    with EmbeddedServer(tmp_path_factory.mktemp("nats-secured"), extra_config=extra) as server:
        yield server


@pytest.fixture
async def settings(secured_server: EmbeddedServer, pki: Pki) -> EventStoreSettings:
    """Settings for a fresh stream on the secured server, holding 30 deposits on three accounts."""
    tag = uuid.uuid4().hex[:10]
    settings = EventStoreSettings(
        nats_url=f"nats://{HOSTNAME}:{secured_server.port}", stream=f"S{tag}", subject_prefix=f"s{tag}",
        user="spark", password=PASSWORD,
        tls_ca_file=pki.ca, tls_cert_file=pki.client_cert, tls_key_file=pki.client_key,
    )
    async with EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        for n in range(30):
            await store.append(StreamId("Account", f"acc-{n % 3}"), [Deposited(amount=n)])
    return settings


def test_read_events_through_tls_and_a_password(spark: SparkSession, settings: EventStoreSettings) -> None:
    rows = read_events(spark, settings, columns=["position", "entity_id", "payload"], partitions=3).collect()
    assert sorted((r.position, r.entity_id, r.payload) for r in rows) == [
        (n + 1, f"acc-{n % 3}", f'{{"amount":{n}}}') for n in range(30)
    ]


def test_the_format_api_takes_the_security_options(spark: SparkSession, settings: EventStoreSettings) -> None:
    source.register(spark)
    options = {"url": settings.nats_url or "", "stream": settings.stream, "subject_prefix": settings.subject_prefix,
               **settings.as_options()}
    df = spark.read.format("jetstream").options(**options).option("from_position", 11).load()
    assert sorted(r.position for r in df.select("position").collect()) == list(range(11, 31))
    plan = io.StringIO()
    with contextlib.redirect_stdout(plan):
        df.explain(extended=True)
    assert "jetstream" in plan.getvalue() and PASSWORD not in plan.getvalue()
    wrong = {**options, "password": "not-it"}
    with pytest.raises(PySparkException, match="rejected the credentials \\(Authorization Violation\\)"):
        spark.read.format("jetstream").options(**wrong).load().collect()
    no_cert = {k: v for k, v in options.items() if k not in ("tls_cert_file", "tls_key_file")}
    with pytest.raises(PySparkException, match="TLS handshake failed"):
        spark.read.format("jetstream").options(**no_cert).load().collect()
    missing = {**options, "tls_ca_file": "/nowhere/ca.pem"}
    with pytest.raises(PySparkException, match="Connection options: tls_ca_file is /nowhere/ca.pem, but there is no file"):
        spark.read.format("jetstream").options(**missing).load().collect()


def test_options_are_checked_and_the_url_is_masked_in_messages(pki: Pki) -> None:
    opts = _options.Options.parse({"URL": "nats://spark:pw@h:1, nats://h2:2", "TLS_CA_FILE": str(pki.ca)})
    assert opts.servers == ("nats://spark:pw@h:1", "nats://h2:2") and opts.url == "nats://spark:***@h:1,nats://h2:2"
    assert opts.security.tls_ca_file == pki.ca
    for bad, message in [
        ({"url": "nats://h:1", "user": "spark"}, "Connection options: user is set but password is not"),
        ({"url": "nats://t0k@h:1", "token": "other"}, "Connection options: The server URL carries credentials"),
        ({"url": "nats://h:1", "tls_hostname": ""}, "Connection options: tls_hostname: String should have at least 1"),
        ({"url": "nats://h:1,wss://spark:pw@h2:443"}, "Connection options: The server URL wss://spark:\\*\\*\\*@h2:443 .*websocket"),
        ({"url": "spark:pw@h:1"}, None),  # no scheme: nats-py reads nats://
    ]:
        if message is None:
            assert _options.Options.parse(bad).url == "spark:***@h:1"
            continue
        with pytest.raises(EventSourceError, match=message):
            _options.Options.parse(bad)

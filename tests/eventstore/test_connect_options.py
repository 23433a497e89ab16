"""nats-py connect options reach the replays' bulk-read connection, or ``connect()`` refuses them.

Each option a caller may pass to ``EventStore.connect(**options)`` (or set on a
connection given to ``EventStore(nc, ...)``) is used against a real
nats-server that needs it: an append, a load and a replay must all work. The
options replays could not honour, and websocket URLs, are refused before
anything connects, with an error naming them.
"""

from __future__ import annotations

import inspect
import socket
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from eventstore import (
    NO_STREAM, EmbeddedServer, EventStore, EventStoreSettings, InvalidArgumentError, StreamId, find_nats_server,
)
from eventstore.nats_options import HONOURED, NATS_PY_ONLY, REFUSED

from ..secured import HOSTNAME, Operator, Pki, make_operator, make_pki, write_user_seed
from .events import Deposited

PASSWORD = "s3cret-pw"
TOKEN = "t0ken-value"


def test_every_option_of_nats_py_connect_is_honoured_passed_or_refused() -> None:
    options = set(inspect.signature(Client.connect).parameters) - {"self"}
    tables = [HONOURED, NATS_PY_ONLY, set(REFUSED)]
    assert set().union(*tables) == options  # a new nats-py option must be placed in one of them
    assert sum(len(t) for t in tables) == len(options)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def nkey_seed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("nkey") / "user.nk"
    return path, write_user_seed(path)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki, nkey_seed: tuple[Path, str]) -> Iterator[EmbeddedServer]:
    """TLS; alice with a password, an nkey user, and bob, who may only subscribe under the inbox prefix _MY."""
    users = (
        "authorization {\n  users: [\n"
        f'    {{user: alice, password: "{PASSWORD}"}}\n'
        f"    {{nkey: {nkey_seed[1]}}}\n"
        f'    {{user: bob, password: "{PASSWORD}", permissions: {{publish: ">", subscribe: "_MY.>"}}}}\n'
        "  ]\n}\n"
    )
    with EmbeddedServer(tmp_path_factory.mktemp("tls"), extra_config=pki.tls_block(verify_clients=False) + users) as server:
        yield server


@pytest.fixture(scope="module")
def handshake_first_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[str]:
    """TLS before anything else, strictly: the server sends its INFO only over TLS (so EmbeddedServer, which waits
    for a plain INFO, cannot start it). Yields its URL."""
    directory = tmp_path_factory.mktemp("first")
    port = EmbeddedServer().port
    block = pki.tls_block(verify_clients=False).replace("tls {\n", "tls {\n  handshake_first: true\n")
    config = directory / "server.conf"
    config.write_text(f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{directory}" }}\n{block}')
    log = (directory / "server.log").open("wb")
    process = subprocess.Popen([find_nats_server(), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as raw, \
                        trusting(pki).wrap_socket(raw, server_hostname=HOSTNAME) as sock:
                    if sock.recv(4) == b"INFO":
                        break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, (directory / "server.log").read_text()
                time.sleep(0.05)
        yield f"nats://{HOSTNAME}:{port}"
    finally:
        process.terminate()
        process.wait(10)
        log.close()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(tmp_path_factory.mktemp("token"), extra_config=f'authorization {{ token: "{TOKEN}" }}\n') as server:
        yield server


@pytest.fixture(scope="module")
def operator() -> Operator:
    return make_operator()


@pytest.fixture(scope="module")
def operator_server(tmp_path_factory: pytest.TempPathFactory, operator: Operator) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(tmp_path_factory.mktemp("operator"), extra_config=operator.config) as server:
        yield server


def settings(url: str, **security: Any) -> EventStoreSettings:
    tag = uuid.uuid4().hex[:10]
    return EventStoreSettings(nats_url=url, stream=f"S{tag}", subject_prefix=f"s{tag}", request_timeout_s=3, **security)


def trusting(pki: Pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki.ca))


async def works(store: EventStore) -> None:
    """An append, a load and a replay over the bulk-read connection all work."""
    store.registry.register(Deposited)
    account = StreamId("Account", "opts")
    await store.append(account, [Deposited(amount=7)], expected_version=NO_STREAM)
    loaded = await store.read(account)
    replayed = [e async for batch in store.read_all() for e in batch]
    assert [e.data for e in loaded] == [Deposited(amount=7)] and replayed == loaded


async def round_trip(settings: EventStoreSettings, **options: Any) -> None:
    async with EventStore.connect(settings, **options) as store:
        await works(store)


def tls_url(server: EmbeddedServer, host: str = HOSTNAME, userinfo: str = "") -> str:
    return f"nats://{userinfo}{host}:{server.port}"


async def test_user_and_password(tls_server: EmbeddedServer, pki: Pki) -> None:
    await round_trip(settings(tls_url(tls_server), tls_ca_file=pki.ca), user="alice", password=PASSWORD)


async def test_token(token_server: EmbeddedServer) -> None:
    await round_trip(settings(token_server.url), token=TOKEN)


async def test_nkeys_seed(tls_server: EmbeddedServer, pki: Pki, nkey_seed: tuple[Path, str]) -> None:
    await round_trip(settings(tls_url(tls_server), tls_ca_file=pki.ca), nkeys_seed=str(nkey_seed[0]))


async def test_user_credentials(operator_server: EmbeddedServer, operator: Operator, tmp_path: Path) -> None:
    creds = operator.write_creds(tmp_path / "user.creds")
    await round_trip(settings(operator_server.url), user_credentials=str(creds))


async def test_tls_context(tls_server: EmbeddedServer, pki: Pki) -> None:
    await round_trip(settings(tls_url(tls_server), user="alice", password=PASSWORD), tls=trusting(pki))


async def test_tls_hostname(tls_server: EmbeddedServer, pki: Pki) -> None:
    url = tls_url(tls_server, host="127.0.0.1")  # the certificate names localhost
    await round_trip(settings(url, user="alice", password=PASSWORD), tls=trusting(pki), tls_hostname=HOSTNAME)


async def test_tls_handshake_first(handshake_first_server: str, pki: Pki) -> None:
    await round_trip(settings(handshake_first_server, tls_ca_file=pki.ca), tls_handshake_first=True)


async def test_inbox_prefix(tls_server: EmbeddedServer, pki: Pki) -> None:
    """bob may only subscribe under _MY: the replays' reply subjects must be there too."""
    await round_trip(settings(tls_url(tls_server), user="bob", password=PASSWORD, tls_ca_file=pki.ca), inbox_prefix="_MY")


async def test_a_connection_of_the_callers_own_lends_its_options_to_replays(tls_server: EmbeddedServer, pki: Pki) -> None:
    nc = await nats.connect(tls_url(tls_server), user="alice", password=PASSWORD, tls=trusting(pki))
    store = EventStore(nc, settings(tls_url(tls_server)))
    try:
        await store.ensure_stream()
        await works(store)
    finally:
        await store.close()


@pytest.mark.parametrize("option", sorted(REFUSED))
async def test_options_replays_cannot_honour_are_refused_before_connecting(option: str) -> None:
    nowhere = settings(f"nats://127.0.0.1:{EmbeddedServer().port}")  # nothing listens: refused before trying
    with pytest.raises(InvalidArgumentError, match=f"connect option {option}=") as caught:
        await EventStore.connect(nowhere, **{option: object()})  # type: ignore[arg-type]
    assert REFUSED[option][1:] in str(caught.value)  # what to do instead


@pytest.mark.parametrize("options", [
    {"password": lambda: "pw", "user": "alice"},
    {"token": lambda: "t"},
    {"user_credentials": ("user.jwt", "user.nk")},
    {"no_such_option": 1},
    {"tls": "not a context"},
])
async def test_option_values_replays_cannot_use_are_refused(options: dict[str, Any]) -> None:
    nowhere = settings(f"nats://127.0.0.1:{EmbeddedServer().port}")
    with pytest.raises(InvalidArgumentError, match=next(iter(options))):
        await EventStore.connect(nowhere, **options)


@pytest.mark.parametrize("scheme", ["ws", "wss"])
async def test_websocket_urls_are_refused_at_connect(scheme: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{scheme}://127.0.0.1:.*nats:// \\(or tls://\\)"):
        await EventStore.connect(settings(f"{scheme}://127.0.0.1:{EmbeddedServer().port}"))


async def test_a_websocket_url_is_refused_for_a_connection_of_the_callers_own(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises(InvalidArgumentError, match="websocket"):
            EventStore(nc, settings(nats_url.replace("nats://", "ws://")))
    finally:
        await nc.close()

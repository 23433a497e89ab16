"""Connecting to secured servers: every way to authenticate, TLS and mutual TLS, and the errors when they are wrong.

Real nats-servers that require credentials and TLS (``EmbeddedServer(extra_config=...)``),
real certificates (trustme), real nkeys and operator JWTs (``tests/secured.py``). Every
successful connection proves itself by appending an event and reading it back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from eventstore import (
    NO_STREAM,
    AuthenticationError,
    ConnectionSecurity,
    EmbeddedServer,
    EventStore,
    EventStoreSettings,
    ServerUnavailableError,
    StreamId,
    connect_options,
)
from eventstore.security import redact_url

from ..secured import HOSTNAME, Operator, Pki, make_operator, make_pki, write_user_seed
from .events import Deposited

PASSWORD = "s3cret-pw"
TOKEN = "t0ken-value"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def nkey_seed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A user nkey seed file and its public key."""
    path = tmp_path_factory.mktemp("nkey") / "user.nk"
    return path, write_user_seed(path)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki, nkey_seed: tuple[Path, str]) -> Iterator[EmbeddedServer]:
    """TLS (server certificate only) and two users: alice with a password, and an nkey user."""
    users = f'authorization {{\n  users: [\n    {{user: alice, password: "{PASSWORD}"}}\n    {{nkey: {nkey_seed[1]}}}\n  ]\n}}\n'
    with EmbeddedServer(tmp_path_factory.mktemp("tls"), extra_config=pki.tls_block(verify_clients=False) + users) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[EmbeddedServer]:
    """Mutual TLS (a client certificate signed by the CA is required) and a token."""
    extra = pki.tls_block(verify_clients=True) + f'authorization {{ token: "{TOKEN}" }}\n'
    with EmbeddedServer(tmp_path_factory.mktemp("mtls"), extra_config=extra) as server:
        yield server


@pytest.fixture(scope="module")
def operator() -> Operator:
    return make_operator()


@pytest.fixture(scope="module")
def operator_server(tmp_path_factory: pytest.TempPathFactory, operator: Operator) -> Iterator[EmbeddedServer]:
    """Operator (JWT) mode: users come with a .creds file signed by the operator's account."""
    with EmbeddedServer(tmp_path_factory.mktemp("operator"), extra_config=operator.config) as server:
        yield server


def url(server: EmbeddedServer, *, host: str = HOSTNAME, userinfo: str = "", scheme: str = "nats") -> str:
    return f"{scheme}://{userinfo}{host}:{server.port}"


def secured(server_url: str, **security: object) -> EventStoreSettings:
    """Settings for a stream of the test's own on ``server_url``."""
    tag = uuid.uuid4().hex[:10]
    return EventStoreSettings(nats_url=server_url, stream=f"S{tag}", subject_prefix=f"s{tag}", **security)  # type: ignore[arg-type]


async def round_trip(settings: EventStoreSettings) -> None:
    """Append an event through a connection made from ``settings`` and read it back."""
    async with EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        account = StreamId("Account", "secured")
        await store.append(account, [Deposited(amount=42)], expected_version=NO_STREAM)
        events = await store.read(account)
        # A replay goes over the store's bulk-read connection, which authenticates on its own.
        replayed = [e async for batch in store.read_all() for e in batch]
    assert [(e.type, e.data) for e in events] == [("Deposited", Deposited(amount=42))]
    assert replayed == events


# -- ways to authenticate ----------------------------------------------------------------


async def test_user_and_password_from_settings(tls_server: EmbeddedServer, pki: Pki) -> None:
    await round_trip(secured(url(tls_server), user="alice", password=PASSWORD, tls_ca_file=pki.ca))


async def test_user_and_password_in_the_url(tls_server: EmbeddedServer, pki: Pki) -> None:
    await round_trip(secured(url(tls_server, userinfo=f"alice:{PASSWORD}@"), tls_ca_file=pki.ca))


async def test_settings_from_the_environment(
    tls_server: EmbeddedServer, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_URL", url(tls_server))
    monkeypatch.setenv("JETSOURCING_USER", "alice")
    monkeypatch.setenv("JETSOURCING_PASSWORD", PASSWORD)
    monkeypatch.setenv("JETSOURCING_TLS_CA_FILE", str(pki.ca))
    monkeypatch.setenv("JETSOURCING_STREAM", f"E{uuid.uuid4().hex[:10]}")
    settings = EventStoreSettings()
    assert settings.user == "alice" and settings.tls_ca_file == pki.ca
    await round_trip(settings)


async def test_nkey_seed_file(tls_server: EmbeddedServer, pki: Pki, nkey_seed: tuple[Path, str]) -> None:
    await round_trip(secured(url(tls_server), nkey_seed_file=nkey_seed[0], tls_ca_file=pki.ca))


async def test_mutual_tls_with_a_token(mtls_server: EmbeddedServer, pki: Pki) -> None:
    client = {"tls_ca_file": pki.ca, "tls_cert_file": pki.client_cert, "tls_key_file": pki.client_key}
    await round_trip(secured(url(mtls_server), token=TOKEN, **client))
    await round_trip(secured(url(mtls_server, userinfo=f"{TOKEN}@"), **client))  # the token in the URL


async def test_credentials_file_in_operator_mode(
    operator_server: EmbeddedServer, operator: Operator, tmp_path: Path
) -> None:
    await round_trip(secured(operator_server.url, credentials_file=operator.write_creds(tmp_path / "user.creds")))


async def test_tls_hostname_names_the_certificate_when_the_url_has_an_ip(tls_server: EmbeddedServer, pki: Pki) -> None:
    by_ip = url(tls_server, host="127.0.0.1")  # the certificate names localhost only
    await round_trip(secured(by_ip, user="alice", password=PASSWORD, tls_ca_file=pki.ca, tls_hostname=HOSTNAME))
    with pytest.raises(AuthenticationError, match="certificate could not be verified.*IP address mismatch"):
        await EventStore.connect(secured(by_ip, user="alice", password=PASSWORD, tls_ca_file=pki.ca))


def test_connect_options_carry_only_what_is_set(pki: Pki, nkey_seed: tuple[Path, str]) -> None:
    assert connect_options(ConnectionSecurity()) == {}
    options = connect_options(ConnectionSecurity(user="alice", password=PASSWORD, tls_ca_file=pki.ca, tls_hostname="h"))
    assert {k: v for k, v in options.items() if k != "tls"} == {"user": "alice", "password": PASSWORD, "tls_hostname": "h"}
    assert options["tls"].verify_mode.name == "CERT_REQUIRED"
    assert connect_options(ConnectionSecurity(nkey_seed_file=nkey_seed[0])) == {"nkeys_seed": str(nkey_seed[0])}


# -- failures: typed, clear, fast ---------------------------------------------------------


async def test_a_wrong_password_fails_at_once_with_a_clear_error(tls_server: EmbeddedServer, pki: Pki) -> None:
    settings = secured(url(tls_server), user="alice", password="wrong-password", tls_ca_file=pki.ca, request_timeout_s=10)
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match="rejected the credentials \\(Authorization Violation\\)") as caught:
        await EventStore.connect(settings)
    assert time.monotonic() - started < 2  # not retried for request_timeout_s
    assert isinstance(caught.value, ServerUnavailableError)
    assert "wrong-password" not in str(caught.value)
    # credentials in the URL: the same error, with the password masked
    with pytest.raises(AuthenticationError) as caught:
        await EventStore.connect(secured(url(tls_server, userinfo="alice:wrong-password@"), tls_ca_file=pki.ca))
    assert "alice:***@" in str(caught.value) and "wrong-password" not in str(caught.value)


async def test_wrong_token_nkey_and_creds_are_rejected(
    mtls_server: EmbeddedServer, tls_server: EmbeddedServer, operator_server: EmbeddedServer, pki: Pki, tmp_path: Path
) -> None:
    client = {"tls_ca_file": pki.ca, "tls_cert_file": pki.client_cert, "tls_key_file": pki.client_key}
    with pytest.raises(AuthenticationError, match="Authorization Violation"):
        await EventStore.connect(secured(url(mtls_server), token="not-the-token", **client))
    stranger = tmp_path / "stranger.nk"
    write_user_seed(stranger)  # a valid seed the server does not know
    with pytest.raises(AuthenticationError, match="Authorization Violation"):
        await EventStore.connect(secured(url(tls_server), nkey_seed_file=stranger, tls_ca_file=pki.ca))
    foreign = make_operator()  # a user signed by an account this server does not trust
    creds = foreign.write_creds(tmp_path / "foreign.creds")
    with pytest.raises(AuthenticationError, match="Authorization Violation"):
        await EventStore.connect(secured(operator_server.url, credentials_file=creds))


async def test_an_untrusted_server_certificate_is_a_clear_error(tls_server: EmbeddedServer, pki: Pki) -> None:
    with pytest.raises(AuthenticationError, match="certificate could not be verified.*Set tls_ca_file") as caught:
        await EventStore.connect(secured(url(tls_server), user="alice", password=PASSWORD, tls_ca_file=pki.other_ca))
    assert "certificate verify failed" in str(caught.value.__cause__)
    # A tls:// URL without tls_ca_file trusts the system store, which does not hold the test CA.
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match="unable to get local issuer certificate"):
        await EventStore.connect(secured(url(tls_server, scheme="tls"), user="alice", password=PASSWORD))
    assert time.monotonic() - started < 3


async def test_a_server_without_tls_is_refused_when_tls_was_asked_for(tmp_path: Path, pki: Pki) -> None:
    """nats-py alone would send the CONNECT (credentials included) in plain text."""
    with EmbeddedServer(tmp_path) as plain:
        with pytest.raises(AuthenticationError, match="does not require TLS, but a tls:// URL or the tls_\\* settings"):
            await EventStore.connect(secured(url(plain, scheme="tls"), token=TOKEN))
        with pytest.raises(AuthenticationError, match="does not require TLS"):
            await EventStore.connect(secured(url(plain), user="alice", password=PASSWORD, tls_ca_file=pki.ca))
        await round_trip(secured(url(plain)))  # no TLS asked for: the same server is fine


def test_connect_options_check_the_files_again(tmp_path: Path, pki: Pki) -> None:
    """On a Spark executor the settings arrive already made: a file missing there is named too."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(pki.ca.read_bytes())
    security = ConnectionSecurity(tls_ca_file=ca)
    ca.unlink()
    with pytest.raises(ValueError, match=f"tls_ca_file is {ca}, but there is no file there"):
        connect_options(security)


async def test_mutual_tls_without_a_client_certificate_is_a_clear_error(mtls_server: EmbeddedServer, pki: Pki) -> None:
    with pytest.raises(AuthenticationError, match="TLS handshake failed.*set tls_cert_file and tls_key_file"):
        await EventStore.connect(secured(url(mtls_server), token=TOKEN, tls_ca_file=pki.ca))


async def test_an_unreachable_server_hides_the_password_in_its_error() -> None:
    port = EmbeddedServer().port  # a free port nobody listens on
    with pytest.raises(ServerUnavailableError, match="Could not connect") as caught:
        await EventStore.connect(EventStoreSettings(nats_url=f"nats://bob:hunter2@127.0.0.1:{port}", request_timeout_s=0.5))
    assert not isinstance(caught.value, AuthenticationError)
    assert "hunter2" not in str(caught.value) and "bob:***@127.0.0.1" in str(caught.value)


def test_redact_url() -> None:
    assert redact_url("nats://a:b@h:1, tls://tok@h2:2,nats://h3:3") == "nats://a:***@h:1,tls://***@h2:2,nats://h3:3"


# -- settings validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"user": "alice"}, "user is set but password is not"),
        ({"password": PASSWORD}, "password is set but user is not"),
        ({"user": "alice", "password": PASSWORD, "token": TOKEN}, "one way to authenticate.*user/password and token"),
        ({"nats_url": "nats://alice:pw@h:4222", "token": TOKEN}, "URL carries credentials.*token is set too"),
        ({"tls_cert_file": "CERT"}, "tls_cert_file is set but tls_key_file is not"),
        ({"tls_key_file": "KEY"}, "tls_key_file is set but tls_cert_file is not"),
        ({"tls_ca_file": "/no/such/ca.pem"}, "tls_ca_file is /no/such/ca.pem, but there is no file there"),
        ({"credentials_file": "/no/such.creds"}, "credentials_file is /no/such.creds, but there is no file there"),
        ({"nkey_seed_file": "CA"}, "nkey_seed_file .* does not hold an nkey seed"),
        ({"credentials_file": "CA"}, "credentials_file .* is not a .creds file"),
        ({"tls_ca_file": "KEY"}, "tls_ca_file .* holds no PEM CA certificate"),
        ({"tls_cert_file": "CA", "tls_key_file": "CERT"}, "cannot be loaded as a certificate and its unencrypted"),
    ],
)
def test_settings_say_what_is_wrong(values: dict[str, str], message: str, pki: Pki) -> None:
    files = {"CA": str(pki.ca), "CERT": str(pki.client_cert), "KEY": str(pki.client_key)}
    with pytest.raises(ValidationError, match=message) as caught:
        EventStoreSettings(**{k: files.get(v, v) for k, v in values.items()})  # type: ignore[arg-type]
    assert PASSWORD not in str(caught.value) and TOKEN not in str(caught.value)


def test_secrets_stay_out_of_reprs(pki: Pki) -> None:
    settings = EventStoreSettings(user="alice", password=PASSWORD, tls_ca_file=pki.ca)
    assert PASSWORD not in repr(settings) and PASSWORD not in str(settings)
    assert PASSWORD not in repr(ConnectionSecurity(token=PASSWORD))
    assert settings.as_options() == {"user": "alice", "password": PASSWORD, "tls_ca_file": str(pki.ca)}


def test_the_embedded_server_keeps_its_config_and_adds_the_extra(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path, max_payload=2048, extra_config="authorization { token: abc }")
    config = server._write_config().read_text()
    assert "max_payload: 2048" in config and config.rstrip().endswith("authorization { token: abc }")

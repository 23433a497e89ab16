"""A password or token in a server URL, in every form nats-py accepts, never reaches an error message or a log line.

nats-py takes ``user:secret@host:4222`` (no scheme) as ``nats://user:secret@host:4222``;
the event store's connection, its replays' bulk-read connection and the settings'
repr must all hide the secret, however the URL is written.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest

from eventstore import (
    NO_STREAM,
    AuthenticationError,
    ConnectionSecurity,
    EmbeddedServer,
    EventStore,
    EventStoreSettings,
    EventStoreError,
    StreamId,
)
from eventstore.jetstream import BulkConnection
from eventstore.security import redact_url

from .events import Deposited

SECRET = "s3cret-in-url"
TOKEN = "t0ken-in-url"


def forms(where: str) -> list[str]:
    """Every way nats-py accepts to put a password or token into the URL of ``where`` (host, or host:port)."""
    return [
        f"nats://alice:{SECRET}@{where}",
        f"tls://alice:{SECRET}@{where}",
        f"alice:{SECRET}@{where}",  # no scheme: nats-py reads nats://
        f"nats://{TOKEN}@{where}",
        f"{TOKEN}@{where}",
        f"nats://alice:{SECRET}@{where}, alice:{SECRET}@{where}",  # a list
        f"ws://alice:{SECRET}@{where}",
        f"wss://alice:{SECRET}@{where}",
        f"alice:p@ss/w?r#{SECRET}@{where}",  # a password a URL parser would cut at '/'
    ]


def texts(error: BaseException) -> str:
    """The message of ``error`` and of every error it was raised from."""
    out: list[str] = []
    seen: BaseException | None = error
    while seen is not None and len(out) < 20:
        out.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return "\n".join(out)


def assert_hidden(text: str) -> None:
    assert SECRET not in text and TOKEN not in text, text


@pytest.mark.parametrize("url", forms("nats.example.com:4222") + forms("nats.example.com") + forms("10.0.0.1:4222"))
def test_redact_url_hides_the_secret_of_every_form(url: str) -> None:
    shown = redact_url(url)
    assert_hidden(shown)
    assert "nats.example.com" in shown or "10.0.0.1" in shown
    assert_hidden(repr(EventStoreSettings(nats_url=url)))
    assert_hidden(str(EventStoreSettings(nats_url=url)))


def test_redact_url_keeps_what_is_not_secret() -> None:
    assert redact_url("alice:pw@h:1, tok@h2,nats://h3:3,h4") == "alice:***@h:1,***@h2,nats://h3:3,h4"


@pytest.mark.parametrize("url", [f"alice:{SECRET}@h:4222", f"{TOKEN}@h"])
def test_credentials_in_a_url_without_scheme_are_not_combined_with_settings(url: str) -> None:
    with pytest.raises(ValueError, match="carries credentials") as caught:
        EventStoreSettings(nats_url=url, user="bob", password="x")  # type: ignore[arg-type]
    assert_hidden(str(caught.value))


@pytest.fixture(scope="module")
def free_port() -> int:
    return EmbeddedServer().port  # a free port nobody listens on


@pytest.mark.parametrize("form", range(len(forms("h:1"))))
async def test_an_unreachable_server_hides_the_secret_in_errors_and_logs(
    form: int, free_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    url = forms(f"127.0.0.1:{free_port}")[form]
    caplog.set_level(logging.DEBUG)
    with pytest.raises(EventStoreError) as caught:
        await EventStore.connect(EventStoreSettings(nats_url=url, request_timeout_s=0.5))
    assert_hidden(texts(caught.value))
    assert "127.0.0.1" in str(caught.value)
    if not url.startswith("ws"):  # the replays' connection (ws:// is refused before it is opened)
        with pytest.raises(EventStoreError) as caught:
            await BulkConnection.open([u.strip() for u in url.split(",")], ConnectionSecurity(), deadline_s=0.3)
        assert_hidden(texts(caught.value))
    assert_hidden("\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records))


@pytest.fixture(scope="module")
def password_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    users = f'authorization {{\n  users: [ {{user: alice, password: "{SECRET}"}} ]\n}}\n'
    with EmbeddedServer(tmp_path_factory.mktemp("pw"), extra_config=users) as server:
        yield server


async def test_a_url_without_scheme_authenticates_appends_and_replays(password_server: EmbeddedServer) -> None:
    tag = uuid.uuid4().hex[:10]
    settings = EventStoreSettings(nats_url=f"alice:{SECRET}@127.0.0.1:{password_server.port}", stream=f"S{tag}",
                                  subject_prefix=f"s{tag}")
    async with EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        await store.append(StreamId("Account", "a"), [Deposited(amount=1)], expected_version=NO_STREAM)
        replayed = [e async for batch in store.read_all() for e in batch]
    assert [e.data for e in replayed] == [Deposited(amount=1)]


@pytest.mark.parametrize("userinfo", [f"alice:wrong-{SECRET}@", f"wrong-{TOKEN}@"])
@pytest.mark.parametrize("scheme", ["nats://", ""])
async def test_a_rejected_secret_in_the_url_is_hidden(
    password_server: EmbeddedServer, userinfo: str, scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"{scheme}{userinfo}127.0.0.1:{password_server.port}"
    with pytest.raises(AuthenticationError) as caught:
        await EventStore.connect(EventStoreSettings(nats_url=url, request_timeout_s=2))
    assert_hidden(texts(caught.value))
    with pytest.raises(AuthenticationError) as caught:
        await BulkConnection.open([url], ConnectionSecurity(), deadline_s=2)
    assert_hidden(texts(caught.value))
    assert_hidden("\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records))

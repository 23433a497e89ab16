"""Two test sessions on one machine never disturb each other: the session's servers keep their data and sockets
outside pytest's numbered temp folders, which every session prunes when it ends (see tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from eventstore import EmbeddedServer


def test_the_sessions_servers_live_outside_pytests_numbered_temp_folders(
    postgres_url: str, nats_server: EmbeddedServer | None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    numbered = tmp_path_factory.getbasetemp().resolve().parent  # pytest-of-<user>, holding pytest-<n> per session
    socket_dir = Path(parse_qs(urlsplit(postgres_url).query)["host"][0]).resolve()
    assert socket_dir.exists() and not socket_dir.is_relative_to(numbered), socket_dir
    if nats_server is not None:
        assert not nats_server.storage_dir.resolve().is_relative_to(numbered), nats_server.storage_dir

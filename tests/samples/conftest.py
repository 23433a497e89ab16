"""Fixtures of the sample tests: a bank on the per-test stream of the session's real nats-server."""

from __future__ import annotations

import pytest

from eventstore import EventStore
from samples.bank import Bank


@pytest.fixture
def bank(store: EventStore) -> Bank:
    return Bank(store)

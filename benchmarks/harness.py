"""What the benchmark scripts share: their command line and progress lines, and commits in the event store's wire
format to fill streams with (published directly, faster than appends)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from eventstore import StreamId, encode_commit
from eventstore.wire import utc_now_text

Commit = tuple[str, bytes, dict[str, str]]
"""A message to publish: (subject, body, headers)."""


def run(main: Callable[[bool], Coroutine[Any, Any, dict[str, Any]]], doc: str | None) -> None:
    """Run ``main(quick)`` with ``--quick`` from the command line and print its result as one JSON line; ``doc``
    (the script's docstring) gives ``--help`` its description."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run, for trying changes")
    print(json.dumps(asyncio.run(main(parser.parse_args().quick))))


def progress(text: str) -> None:
    """Print ``text`` on stderr, after the running script's name."""
    print(f"[{Path(sys.argv[0]).stem}] {text}", file=sys.stderr, flush=True)


def wire_commit(subject: str, type_name: str, version: int, payload: bytes) -> Commit:
    """A commit of one event of ``type_name``, ``version`` of the entity of ``subject``."""
    headers, body = encode_commit(
        msg_id=uuid.uuid4().hex, types=[type_name], schema_versions=[1], event_ids=[uuid.uuid4().hex],
        payloads=[payload], last_version=version, recorded_at=utc_now_text(),
    )
    return subject, body, headers


class Noise:
    """Commits of one event each of 20,000 ``Noise`` entities picked at random: the other traffic of a stream that
    the measured entities are spread through."""

    def __init__(self, subject_prefix: str, type_name: str, payload: bytes, seed: int) -> None:
        self._prefix = subject_prefix
        self._type_name = type_name
        self._payload = payload
        self._rng = random.Random(seed)
        self._versions = [0] * 20_000

    def commits(self, count: int) -> Iterator[Commit]:
        """The next ``count`` commits, each one the next version of its entity."""
        for _ in range(count):
            n = self._rng.randrange(len(self._versions))
            self._versions[n] += 1
            yield wire_commit(StreamId("Noise", f"n{n}").subject(self._prefix), self._type_name, self._versions[n],
                              self._payload)

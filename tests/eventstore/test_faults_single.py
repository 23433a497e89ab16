"""Fault tests on one embedded nats-server: SIGKILL under load, a client killed mid-batch, a full or read-only
disk. The workload and its checker are in ``tests/support/workload.py``."""

from __future__ import annotations

import json

from eventstore import RecordedEvent, StreamId
from tests.support.workload import CATEGORY, check_events


def _event(position: int, entity: str, version: int, command: str, part: int, parts: int, entities: list[str]) -> RecordedEvent:
    payload = json.dumps({"command": command, "part": part, "parts": parts, "entities": entities}).encode()
    return RecordedEvent(position, part, StreamId(CATEGORY, entity), version, "WorkStep", 1, f"id{position}-{part}",
                         payload, "2026-01-01T00:00:00+00:00")


def test_the_checker_finds_partial_commands_duplicates_and_gaps() -> None:
    whole = [_event(1, "a", 1, "c1", 0, 2, ["a"]), _event(1, "a", 2, "c1", 1, 2, ["a"])]
    report, stored = check_events(whole)
    assert (report.partial_commands, report.duplicated, report.gaps, stored) == (0, 0, 0, {"c1": {"a": (1, 2)}})

    half_batch = whole + [_event(2, "b", 1, "c2", 0, 1, ["b", "c"])]  # c2 also names entity c, which has nothing
    assert check_events(half_batch)[0].partial_commands == 1
    half_commit = whole + [_event(2, "b", 1, "c2", 0, 2, ["b"])]  # part 1 of 2 is missing
    assert check_events(half_commit)[0].partial_commands == 1
    twice = whole + [_event(3, "a", 3, "c1", 0, 2, ["a"]), _event(3, "a", 4, "c1", 1, 2, ["a"])]
    assert check_events(twice)[0].duplicated >= 2
    gap = whole + [_event(2, "a", 4, "c3", 0, 1, ["a"])]
    assert check_events(gap)[0].gaps == 1

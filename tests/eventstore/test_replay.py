"""The one replay's pieces that the end-to-end tests reach only with the native accelerator built or not."""

from __future__ import annotations

import pytest

from eventstore.jetstream.replay import Commits, Parsed, Part, _split_unfinished_batch
from eventstore.wire import Header


def message(n: int, batch: str | None = None, *, commit: bool = False) -> dict[str, str]:
    headers = {Header.TYPE: "Deposited", Header.VERSION: str(n)}
    if batch is not None:
        headers[Header.BATCH_ID] = batch
        if commit:
            headers[Header.BATCH_COMMIT] = "1"
    return headers


def as_part(kind: str, start: int, messages: list[dict[str, str]]) -> Part:
    positions = list(range(start, start + len(messages)))
    subjects = [b"ev.Account.a"] * len(messages)
    bodies = [b"{}"] * len(messages)
    if kind == "parsed":
        return Parsed(start, start + len(messages) - 1, 0, positions, subjects, messages, bodies)
    blocks = [b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in m.items()) + b"\r\n" for m in messages]
    return Commits(positions, subjects, blocks, bodies)


def positions(parts: list[Part]) -> list[int]:
    return [p for part in parts for p in part.position_list()]


@pytest.mark.parametrize("kind", ["commits", "parsed"])
def test_the_end_of_an_unfinished_batch_is_held_back_across_parts(kind: str) -> None:
    # 1-2 plain, 3-7 one batch without its commit yet, split over two parts.
    first = as_part(kind, 1, [message(1), message(2), message(3, "b"), message(4, "b")])
    second = as_part(kind, 5, [message(5, "b"), message(6, "b"), message(7, "b")])
    kept, held = _split_unfinished_batch([first, second])
    assert positions(kept) == [1, 2] and positions(held) == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("kind", ["commits", "parsed"])
def test_a_whole_batch_or_no_batch_is_handed_over(kind: str) -> None:
    whole = [as_part(kind, 1, [message(1, "a"), message(2, "a", commit=True)])]
    assert _split_unfinished_batch(whole) == (whole, [])
    plain = [as_part(kind, 1, [message(1), message(2)])]
    assert _split_unfinished_batch(plain) == (plain, [])


@pytest.mark.parametrize("kind", ["commits", "parsed"])
def test_only_the_last_batch_is_held_when_another_ends_before_it(kind: str) -> None:
    parts = [as_part(kind, 1, [message(1, "a"), message(2, "a", commit=True), message(3, "b"), message(4, "b")])]
    kept, held = _split_unfinished_batch(parts)
    assert positions(kept) == [1, 2] and positions(held) == [3, 4]


@pytest.mark.parametrize("kind", ["commits", "parsed"])
def test_a_list_that_is_all_one_unfinished_batch_is_held_whole(kind: str) -> None:
    parts = [as_part(kind, 1, [message(1, "b")]), as_part(kind, 2, [message(2, "b")])]
    kept, held = _split_unfinished_batch(parts)
    assert kept == [] and positions(held) == [1, 2]

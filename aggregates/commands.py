"""What :meth:`Repository.execute` returns, and how it retries a command after a concurrent change."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["CacheStats", "CommandResult", "RetryPolicy"]

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often a command is retried after a :class:`~eventstore.ConcurrencyError`, and how long to wait.

    A command is saved at most ``attempts`` times. Before retry ``n`` (0-based)
    it waits a random time between 0 and ``min(max_delay_s, base_delay_s * 2**n)``
    ("full jitter"), so competing writers spread out instead of colliding again.
    The defaults suit a hot aggregate written by several processes at once
    (where a writer can lose dozens of times in a row); they give up after
    about five seconds of waiting.
    """

    attempts: int = 50
    base_delay_s: float = 0.002
    max_delay_s: float = 0.2

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError(f"{self!r}: attempts must be >= 1 and delays >= 0.")

    def delay_s(self, retry: int) -> float:
        """The jittered wait before retry number ``retry`` (0 for the first retry)."""
        return random.uniform(0.0, min(self.max_delay_s, self.base_delay_s * 2.0**retry))


@dataclass(frozen=True, slots=True)
class CommandResult(Generic[R]):
    """The outcome of a command: the aggregate's version and position after it, and what it returned.

    ``duplicate`` is True when the command id had already been stored by an
    earlier run: nothing new was stored, ``version`` and ``position`` are those
    of that first run, and ``value`` is None. When the command recorded
    nothing, ``version`` and ``position`` are the aggregate's current ones.

    ``note`` is the text stored with the command's commit when
    :meth:`Repository.execute` was given a ``note`` function: this run's, or
    for a duplicate the first run's (None when that run stored none).
    """

    value: R | None
    version: int
    position: int
    duplicate: bool = False
    note: str | None = None


@dataclass(slots=True)
class CacheStats:
    """How a repository's commands found their aggregate in its cache, counted once per command.

    ``hits``: the cached copy was current (the command cost one append, or nothing); ``stale``: a
    cached copy was there, but the store had moved on (another process wrote the aggregate: a
    conflict and a catch-up); ``misses``: no cached copy (a load). Commands that raise before
    their aggregate is found count as nothing.
    """

    hits: int = 0
    stale: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits`` over all commands counted (1.0 before any)."""
        total = self.hits + self.stale + self.misses
        return self.hits / total if total else 1.0

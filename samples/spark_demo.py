"""Step 5 of the demo: Spark and Delta Lake (filled in once Spark projections are exported)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from samples.demo import Demo

__all__ = ["run_spark"]


async def run_spark(demo: "Demo") -> None:
    """Placeholder."""
    raise NotImplementedError("Spark projections are not exported by spark_projections yet.")

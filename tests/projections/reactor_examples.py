"""A reactor the CLI tests load by import path (``reactor_examples:shipper``); run with ``tests/projections`` on
``PYTHONPATH``. Its side effect is a line per shipped order in the file ``$SHIPPED_LOG``; the orders listed in
``$SHIPPER_BROKEN`` (comma-separated) fail."""

from __future__ import annotations

import os

from pydantic import BaseModel

from eventstore import RecordedEvent
from projections import Reactor


class Shipped(BaseModel):
    n: int


async def _ship(event: RecordedEvent) -> None:
    n = event.data.n  # type: ignore[attr-defined]
    if str(n) in os.environ.get("SHIPPER_BROKEN", "").split(","):
        raise RuntimeError(f"order {n} still cannot ship")
    with open(os.environ["SHIPPED_LOG"], "a") as log:
        log.write(f"{n}\n")


shipper = Reactor("shipper", handlers={Shipped: _ship})

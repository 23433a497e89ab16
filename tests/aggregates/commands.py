"""The bank's command models for the commands-over-NATS tests (services, workers and clients alike)."""

from __future__ import annotations

from pydantic import BaseModel


class Open(BaseModel):
    owner: str


class Deposit(BaseModel):
    amount: int

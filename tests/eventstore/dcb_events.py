"""Event models of the DCB tests: the course, student and username events of ``samples/courses.py``, and a blob."""

from __future__ import annotations

from pydantic import BaseModel

from eventstore import TypeRegistry
from samples.courses import CourseDefined, StudentSubscribed, UsernameClaimed


class Blob(BaseModel):
    text: str


def register(registry: TypeRegistry) -> None:
    """Register the DCB tests' events."""
    for model in (CourseDefined, StudentSubscribed, UsernameClaimed, Blob):
        registry.register(model)

"""Event models of the DCB tests: the course, student and username events of ``samples/courses.py``, and a blob."""

from __future__ import annotations

from pydantic import BaseModel

from samples.courses import CourseDefined, StudentSubscribed, UsernameClaimed


class Blob(BaseModel):
    text: str


DCB_EVENTS: list[type[BaseModel]] = [CourseDefined, StudentSubscribed, UsernameClaimed, Blob]

"""Event models of the DCB tests: courses and students (dcb.events' example), and usernames."""

from __future__ import annotations

from pydantic import BaseModel


class CourseDefined(BaseModel):
    course: str
    capacity: int


class StudentSubscribed(BaseModel):
    student: str
    course: str


class UsernameClaimed(BaseModel):
    username: str
    user: str


class Blob(BaseModel):
    text: str


DCB_EVENTS: list[type[BaseModel]] = [CourseDefined, StudentSubscribed, UsernameClaimed, Blob]

"""Rules across entities without sagas: course subscriptions and unique usernames, as decisions on queries
(dynamic consistency boundaries, dcb.events' own examples), written against the public API only.

* A course has a capacity; a student subscribes to at most :data:`MAX_COURSES` courses, to each once.
* A username belongs to one user at a time; a user may release it, and change theirs in one step.

Each command reads exactly the events its rules depend on (a course's, a student's, a username's) and appends
under the condition that none of them changed meanwhile; no course, student or username "aggregate" holds a lock.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from aggregates import DecisionResult, Decisions, DomainError, Fold
from eventstore import Query, SequencedEvent, TaggedEvent, TypeRegistry

MAX_COURSES = 3
"""How many courses a student may subscribe to."""


class CourseDefined(BaseModel):
    """A course was opened with ``capacity`` places."""

    course: str
    capacity: int


class StudentSubscribed(BaseModel):
    """``student`` took a place in ``course``."""

    student: str
    course: str


class UsernameClaimed(BaseModel):
    """``user`` owns ``username`` from now on."""

    username: str
    user: str


class UsernameReleased(BaseModel):
    """``user`` gave ``username`` up."""

    username: str
    user: str


EVENTS: tuple[type[BaseModel], ...] = (CourseDefined, StudentSubscribed, UsernameClaimed, UsernameReleased)


def register(registry: TypeRegistry) -> None:
    """Register this domain's events."""
    for model in EVENTS:
        if model.__name__ not in registry:
            registry.register(model)


def _course(c: str) -> str:
    return f"course:{c}"


def _student(s: str) -> str:
    return f"student:{s}"


def _username(u: str) -> str:
    return f"username:{u}"


def _count(n: int, _: SequencedEvent) -> int:
    return n + 1


def _capacity(_: int | None, event: SequencedEvent) -> int:
    data = event.data
    assert isinstance(data, CourseDefined)
    return data.capacity


def _owner(_: str | None, event: SequencedEvent) -> str | None:
    data = event.data
    assert isinstance(data, (UsernameClaimed, UsernameReleased))
    return data.user if isinstance(data, UsernameClaimed) else None


def _owner_of(username: str) -> Fold[str | None]:
    return Fold(Query.of(types=["UsernameClaimed", "UsernameReleased"], tags=[_username(username)]), None, _owner)


class Courses:
    """The commands of the course and username rules, on a store's DCB log."""

    def __init__(self, decisions: Decisions) -> None:
        self.decisions = decisions

    async def define_course(self, course: str, capacity: int, *, command_id: str | None = None) -> DecisionResult:
        """Open ``course`` with ``capacity`` places; refused if it exists."""
        def decide(state: dict[str, Any]) -> list[TaggedEvent]:
            if state["capacity"] is not None:
                raise DomainError(f"Course {course!r} exists already.")
            return [TaggedEvent(CourseDefined(course=course, capacity=capacity), {_course(course)})]

        defined = Fold(Query.of(types=["CourseDefined"], tags=[_course(course)]), None, _capacity)
        return await self.decisions.execute({"capacity": defined}, decide, command_id=command_id)

    async def subscribe(self, student: str, course: str, *, command_id: str | None = None) -> DecisionResult:
        """Give ``student`` a place in ``course``: refused when the course does not exist or is full, when the
        student holds a place there already, or holds :data:`MAX_COURSES` places."""
        def decide(state: dict[str, Any]) -> list[TaggedEvent]:
            if state["capacity"] is None:
                raise DomainError(f"There is no course {course!r}.")
            if state["already"]:
                raise DomainError(f"{student} is subscribed to {course!r} already.")
            if state["taken"] >= state["capacity"]:
                raise DomainError(f"Course {course!r} is full.")
            if state["courses"] >= MAX_COURSES:
                raise DomainError(f"{student} is subscribed to {MAX_COURSES} courses already.")
            return [TaggedEvent(StudentSubscribed(student=student, course=course), {_course(course), _student(student)})]

        folds: dict[str, Fold[Any]] = {
            "capacity": Fold(Query.of(types=["CourseDefined"], tags=[_course(course)]), None, _capacity),
            "taken": Fold(Query.of(types=["StudentSubscribed"], tags=[_course(course)]), 0, _count),
            "already": Fold(Query.of(types=["StudentSubscribed"], tags=[_course(course), _student(student)]), 0, _count),
            "courses": Fold(Query.of(types=["StudentSubscribed"], tags=[_student(student)]), 0, _count),
        }
        return await self.decisions.execute(folds, decide, command_id=command_id)

    async def claim_username(self, username: str, user: str, *, command_id: str | None = None) -> DecisionResult:
        """Make ``user`` the owner of ``username``; refused while another user owns it."""
        def decide(state: dict[str, Any]) -> list[TaggedEvent]:
            if state["owner"] is not None:
                raise DomainError(f"Username {username!r} is taken.")
            return [TaggedEvent(UsernameClaimed(username=username, user=user), {_username(username)})]

        return await self.decisions.execute({"owner": _owner_of(username)}, decide, command_id=command_id)

    async def change_username(self, old: str, new: str, user: str, *, command_id: str | None = None) -> DecisionResult:
        """Release ``old`` (which ``user`` must own) and claim ``new`` (which nobody may own) in one append."""
        def decide(state: dict[str, Any]) -> list[TaggedEvent]:
            if state["old"] != user:
                raise DomainError(f"{user} does not own username {old!r}.")
            if state["new"] is not None:
                raise DomainError(f"Username {new!r} is taken.")
            return [TaggedEvent(UsernameReleased(username=old, user=user), {_username(old)}),
                    TaggedEvent(UsernameClaimed(username=new, user=user), {_username(new)})]

        return await self.decisions.execute({"old": _owner_of(old), "new": _owner_of(new)}, decide, command_id=command_id)

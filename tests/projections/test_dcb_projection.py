"""Projections run over a stream holding DCB appends (their commits and index messages) beside entity events."""

from __future__ import annotations

from pydantic import BaseModel

from eventstore import AppendCondition, EventStore, Query, RecordedEvent, StreamId, TaggedEvent
from projections import Projection, ProjectionSettings, Table, Transaction, handles

from projection_examples import AccountBalances, AccountOpened, Deposited
from projection_helpers import burst, dump, memory_fold


class Enrolled(BaseModel):
    student: str
    course: str


class Enrolments(Projection):
    """Students per course, from DCB events."""

    name = "enrolments"
    version = 1
    categories = ("Dcb",)
    tables = (Table("courses", key="course", columns={"course": str, "students": int}),)

    @handles(Enrolled)
    def enrolled(self, event: RecordedEvent, tx: Transaction) -> None:
        data = event.data
        assert isinstance(data, Enrolled)
        row = tx.get("courses", data.course) or {"students": 0}
        tx.upsert("courses", data.course, {"students": row["students"] + 1})


async def test_projections_see_dcb_events_and_never_index_messages(es: EventStore, psettings: ProjectionSettings) -> None:
    es.registry.register(Enrolled)
    await es.dcb.ensure_index()
    await es.append(StreamId("Account", "a1"), [AccountOpened(owner="Ann")])
    for i in range(3):
        await es.dcb.append([TaggedEvent(Enrolled(student=f"s{i}", course="c1"), {"course:c1", f"student:s{i}"})],
                            condition=AppendCondition(Query.of(tags=[f"student:{i}"])))
        await es.append(StreamId("Account", "a1"), [Deposited(amount=i + 1)])
    await es.dcb.append([TaggedEvent(Enrolled(student="s0", course="c2"), {"course:c2", "student:s0"})])
    await burst([AccountBalances(), Enrolments()], psettings, es)
    assert dump(psettings, "enrolments") == {"courses": [{"course": "c1", "students": 3}, {"course": "c2", "students": 1}]}
    assert dump(psettings, "enrolments") == await memory_fold(Enrolments(), es)
    assert [row["balance"] for row in dump(psettings, "account_balances")["balances"]] == [6]

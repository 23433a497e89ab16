"""``jetsourcing dead-letters list|drop``: the projections' and the reactors' dead letters, from a shell."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from eventstore import EventStore, RecordedEvent, StreamId
from projections import ErrorPolicy, PoisonEvent, ProjectionSettings, Reactor, read_status, run_reactor

from projection_examples import ACCOUNT, AccountOpened, Corrupted, Deposited, FragileBalances
from projection_helpers import ROOT, both_stores, burst, cli, cli_env
from reactor_examples import Shipped


async def jetsourcing(settings: ProjectionSettings, *args: str, **env: str) -> tuple[int, str, str]:
    done = await asyncio.to_thread(
        subprocess.run, cli(*args), env={**cli_env(settings), **env}, cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )
    return done.returncode, done.stdout, done.stderr


@both_stores
async def test_list_and_drop_a_projections_dead_letters(es: EventStore, psettings: ProjectionSettings) -> None:
    await es.append(StreamId(ACCOUNT, "dl-1"), [AccountOpened(owner="o")])
    bad = await es.append(StreamId(ACCOUNT, "dl-1"), [Deposited(amount=1), Corrupted(detail="x")])
    lone = await es.append(StreamId(ACCOUNT, "dl-2"), [Corrupted(detail="y")])
    settings = psettings.model_copy(update={"error_policy": ErrorPolicy.DEAD_LETTER})
    await burst([FragileBalances()], settings, es)

    code, out, err = await jetsourcing(settings, "dead-letters", "list", "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert listed["not_read"] is None
    assert [(d["kind"], d["name"], d["position"], d["stream"], d["event_type"]) for d in listed["dead_letters"]] == [
        ("projection", "fragile_balances", bad.position, "Account/dl-1", "Corrupted"),
        ("projection", "fragile_balances", lone.position, "Account/dl-2", "Corrupted"),
    ]
    code, out, _ = await jetsourcing(settings, "dead-letters", "list")
    assert out.splitlines()[0].split() == ["kind", "name", "position", "stream", "type", "error"]

    code, out, err = await jetsourcing(settings, "dead-letters", "drop", "--projection", "fragile_balances",
                                       "--position", str(bad.position))
    assert (code, out.strip()) == (0, "dropped 1 dead letter(s) of projection fragile_balances"), err
    [status] = await read_status(settings, event_store=es)
    assert status.dead_letters == 1 and status.checkpoint == lone.position  # nothing else moved
    code, out, _ = await jetsourcing(settings, "dead-letters", "drop", "--projection", "fragile_balances", "--all")
    assert out.strip() == "dropped 1 dead letter(s) of projection fragile_balances"
    code, out, _ = await jetsourcing(settings, "dead-letters", "list")
    assert out.strip() == "No dead letters."


async def test_list_and_drop_a_reactors_dead_letters(es: EventStore, psettings: ProjectionSettings) -> None:
    es.registry.register(Shipped)
    positions = [(await es.append(StreamId("Order", f"o{n}"), [Shipped(n=n)])).position for n in range(3)]

    async def ship(event: RecordedEvent) -> None:
        if event.data.n != 1:  # type: ignore[attr-defined]
            raise PoisonEvent(f"order {event.data.n} cannot ship")  # type: ignore[attr-defined]

    async with asyncio.timeout(15):
        await run_reactor(es, Reactor("shipper", handler=ship), until_idle=True)
    code, out, err = await jetsourcing(psettings, "dead-letters", "list", "--json")
    assert code == 0, err
    letters = json.loads(out)["dead_letters"]
    assert [(d["kind"], d["name"], d["position"]) for d in letters] == [
        ("reactor", "shipper", positions[0]), ("reactor", "shipper", positions[2]),
    ]
    assert letters[0]["error"] == "poison: PoisonEvent: order 0 cannot ship"
    code, out, err = await jetsourcing(psettings, "dead-letters", "drop", "--reactor", "shipper",
                                       "--position", str(positions[2]))
    assert (code, out.strip()) == (0, "dropped 1 dead letter(s) of reactor shipper"), err
    code, out, _ = await jetsourcing(psettings, "dead-letters", "list", "--json")
    assert [d["position"] for d in json.loads(out)["dead_letters"]] == [positions[0]]


async def test_retry_runs_a_reactor_again_on_its_dead_letters(
    es: EventStore, psettings: ProjectionSettings, tmp_path: Path
) -> None:
    es.registry.register(Shipped)
    positions = [(await es.append(StreamId("Order", f"o{n}"), [Shipped(n=n)])).position for n in range(3)]

    async def broken(event: RecordedEvent) -> None:
        raise PoisonEvent("the carrier is down")

    async with asyncio.timeout(15):
        await run_reactor(es, Reactor("shipper", handler=broken), until_idle=True)
    shipped = tmp_path / "shipped.txt"
    shipped.touch()

    code, out, err = await jetsourcing(psettings, "dead-letters", "retry", "reactor_examples:shipper", "--position",
                                       str(positions[1]), SHIPPED_LOG=str(shipped))
    assert (code, out.strip()) == (0, "retried 1 dead letter(s) of reactor reactor_examples:shipper: handled and "
                                      "deleted; 0 failed again"), err
    assert shipped.read_text() == "1\n"  # the side effect ran, once

    code, out, err = await jetsourcing(psettings, "dead-letters", "retry", "reactor_examples:shipper", "--all",
                                       SHIPPED_LOG=str(shipped), SHIPPER_BROKEN="2")
    assert code == 1, err
    assert out.splitlines() == [
        f"position {positions[2]}: failed again, the dead letter stays: RuntimeError: order 2 still cannot ship",
        "retried 1 dead letter(s) of reactor reactor_examples:shipper: handled and deleted; 1 failed again",
    ]
    assert shipped.read_text() == "1\n0\n"
    code, out, _ = await jetsourcing(psettings, "dead-letters", "list", "--json")
    assert [d["position"] for d in json.loads(out)["dead_letters"]] == [positions[2]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--projection", "balances", "--all"), "apply it out of order"),
        (("--all",), "retry needs the reactor to run"),
        (("reactor_examples:Shipped", "--all"), "not a Reactor"),
        (("no_such_module:thing", "--all"), "no_such_module"),
        (("reactor_examples:shipper",), "needs --position P"),
    ],
)
async def test_retry_refuses_what_it_cannot_do_in_one_line(
    psettings: ProjectionSettings, args: tuple[str, ...], message: str
) -> None:
    code, _, err = await jetsourcing(psettings, "dead-letters", "retry", *args)
    assert code == 1 and len(err.splitlines()) == 1 and err.startswith("jetsourcing: ") and message in err, err


async def test_drop_needs_one_target_and_one_selection(psettings: ProjectionSettings) -> None:
    for args in (("--projection", "p"), ("--projection", "p", "--position", "3", "--all"),
                 ("--position", "3"), ("--projection", "p", "--reactor", "r", "--all")):
        code, _, err = await jetsourcing(psettings, "dead-letters", "drop", *args)
        assert code == 1 and len(err.splitlines()) == 1 and err.startswith("jetsourcing: "), (args, err)

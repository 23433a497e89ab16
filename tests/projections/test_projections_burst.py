"""Burst mode (--until-caught-up) and the equality of SQLite, a clean rebuild and the in-memory fold."""

from __future__ import annotations

from pathlib import Path

from eventstore import EventStore
from projections import ProjectionSettings

from projection_examples import AccountBalances, Movements, append_workload, workload
from projection_helpers import burst, clean_rebuild, dump, memory_fold


async def test_burst_mode_catches_up_and_matches_the_memory_fold(
    es: EventStore, psettings: ProjectionSettings, tmp_path: Path
) -> None:
    await append_workload(es, workload(3000, accounts=300))
    await burst([AccountBalances(), Movements()], psettings, es)
    balances = dump(psettings, "account_balances")
    assert len(balances["balances"]) > 100 and balances["closures"]
    assert balances == await memory_fold(AccountBalances(), es)
    assert dump(psettings, "movements") == await memory_fold(Movements(), es)

    # Appending more and bursting again continues from the checkpoint.
    await append_workload(es, workload(1000, accounts=300, seed=8))
    await burst([AccountBalances(), Movements()], psettings, es)
    assert dump(psettings, "account_balances") == await clean_rebuild(AccountBalances(), psettings, es, tmp_path)
    assert dump(psettings, "movements") == await memory_fold(Movements(), es)

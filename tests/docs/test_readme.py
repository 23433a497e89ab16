"""The README's example is the documentation's example file, and it runs as a reader runs it: ``python bank.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import unique_settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "bank.py"


def test_the_readme_shows_the_example_file_as_it_is() -> None:
    [block] = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert block == EXAMPLE.read_text()


def test_the_example_runs_and_prints_what_the_docs_say(nats_url: str, tmp_path: Path) -> None:
    settings = unique_settings(nats_url)
    env = {
        **os.environ,
        "NATS_URL": nats_url,
        "JETSOURCING_STREAM": settings.stream,
        "JETSOURCING_SUBJECT_PREFIX": settings.subject_prefix,
        "PYTHONPATH": str(ROOT),
    }
    program = tmp_path / "bank.py"
    program.write_text(EXAMPLE.read_text())
    done = subprocess.run(
        [sys.executable, str(program)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "owner='Alice' balance=10 version 2\n"
    assert "owner='Alice' balance=10 version 2" in (ROOT / "docs" / "getting-started.md").read_text()


def test_without_a_server_the_example_says_it_started_its_own(tmp_path: Path) -> None:
    """A reader who has not exported ``NATS_URL`` (or exported it empty) is told the server is private."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("NATS_", "JETSOURCING_"))}
    env.update(NATS_URL="", PYTHONPATH=str(ROOT))
    program = tmp_path / "bank.py"
    program.write_text(EXAMPLE.read_text())
    done = subprocess.run(
        [sys.executable, str(program)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "owner='Alice' balance=10 version 2\n"
    assert "started an embedded nats-server" in done.stderr and "jetsourcing server" in done.stderr

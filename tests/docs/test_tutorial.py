"""The tutorial (docs/tutorial/), run as its reader runs it: the same files, the same commands, the same outputs.

The reader's project is a folder holding the ``library`` package; the test copies ``docs/tutorial/library`` into a
fresh one and runs every command of the pages from there, in subprocesses, against the session's nats-server (on a
stream of its own): the domain tests with a bare pytest, the in-process app, ``jetsourcing serve`` with the client
script, the daemon with ``status``, ``events tail`` and the report, then one Spark rebuild and the Delta report.
``jetsourcing server`` (step 1) gets a server of its own. The commands and outputs checked here are the ones the
pages show (checked by the last test), so a page cannot drift from what runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventstore.server import _free_port
from spark_projections.settings import TEST_PROFILE_CONF

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "tutorial"

# -- the commands the pages give, in the order the reader runs them ----------------------------------------------

SERVER = "jetsourcing server"
EXPORT = "export NATS_URL=nats://127.0.0.1:4222"
PYTEST = "python -m pytest library/test_domain.py"
APP = "python -m library.app"
SERVE = "jetsourcing serve library.service:commands"
CLIENT = "python -m library.client"
RUN = "jetsourcing run library.views:Catalogue"
STATUS = "jetsourcing status"
TAIL = "jetsourcing events tail -n 5 --no-follow"
REPORT = "python -m library.report"
REBUILD = "jetsourcing spark rebuild library.views:Catalogue --root lake"
LAKE = "python -m library.lake"
COMMANDS = (SERVER, EXPORT, PYTEST, APP, SERVE, CLIENT, RUN, STATUS, TAIL, REPORT, REBUILD, LAKE)

# -- what the reader's scripts print, as the pages show it --------------------------------------------------------

APP_OUTPUT = """\
refused: ann holds 2 books: the most this library lends to one member.
Dune: ann
Emma: ann
Ulysses: on the shelves
"""

CLIENT_OUTPUT = """\
OpenLibrary to riverside: done, the library is at version 1
AddBook to riverside: done, the library is at version 2
LendBook to riverside: done, the library is at version 3
LendBook to riverside: refused (BookNotAvailable): Middlemarch is lent to bob.
ReturnBook to central: done, the library is at version 7
"""

CLIENT_RESENT = """\
OpenLibrary to riverside: done, the library is at version 1 (sent before: nothing new was stored)
AddBook to riverside: done, the library is at version 2 (sent before: nothing new was stored)
LendBook to riverside: done, the library is at version 3 (sent before: nothing new was stored)
LendBook to riverside: refused (BookNotAvailable): Middlemarch is lent to bob.
ReturnBook to central: done, the library is at version 7 (sent before: nothing new was stored)
"""

CATALOGUE = """\
central    Dune         -    lent 1x
central    Emma         ann  lent 1x
central    Ulysses      -    lent 0x
riverside  Middlemarch  bob  lent 1x
"""

# The last five commits: step 4 stored six, step 5 four (refused commands store nothing).
TAIL_HEADERS = [
    ("#6.0", "Library/central", "v6", "BookLent"),
    ("#7.0", "Library/riverside", "v1", "LibraryOpened"),
    ("#8.0", "Library/riverside", "v2", "BookAdded"),
    ("#9.0", "Library/riverside", "v3", "BookLent"),
    ("#10.0", "Library/central", "v7", "BookReturned"),
]


def tail_headers(text: str) -> list[tuple[str, ...]]:
    """Position, stream, version and type of each event `jetsourcing events tail` printed in ``text``."""
    return [tuple(line.split()[:4]) for line in text.splitlines() if re.match(r"#\d+\.\d+ ", line)]


READERS_PYTEST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTEST_PLUGINS": "pytest_asyncio.plugin"}
"""pytest as the reader installed it: with pytest-asyncio, without the other plugins of this checkout's environment."""


class Process:
    """A long-running command of the tutorial (a terminal of its own), its output collected as it comes."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.command = command
        self.process = subprocess.Popen(argv(command), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    def wait_for(self, text: str, timeout_s: float = 60) -> str:
        """The first line holding ``text`` (the process must print it within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            self.output.append(line)
            if text in line:
                return line
        raise AssertionError(f"`{self.command}` printed no {text!r}: {''.join(self.output)}")

    def stop(self) -> int:
        """SIGTERM, as the end of a terminal's process; its exit code (it must end within 20 s)."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=20)
        self._reader.join(timeout=10)  # the pipe's last lines (a daemon's counters) come after its exit
        self.drain()
        return code

    def drain(self) -> str:
        """Everything the process printed so far."""
        while not self.lines.empty():
            self.output.append(self.lines.get())
        return "".join(self.output)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def argv(command: str) -> list[str]:
    """The command as this test's interpreter runs it (`jetsourcing` is its console script's module)."""
    program, *args = shlex.split(command)
    if program == "jetsourcing":
        return [sys.executable, "-m", "projections.cli", *args]
    assert program == "python", command
    return [sys.executable, *args]


def run(command: str, cwd: Path, env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a command of the tutorial to its end; it must succeed."""
    done = subprocess.run(argv(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The reader's project folder: the tutorial's ``library`` package and its ``pyproject.toml``, nothing else."""
    shutil.copytree(PAGES / "library", tmp_path / "library", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PAGES / "pyproject.toml", tmp_path)
    return tmp_path


@pytest.fixture
def environment(nats_url: str, tmp_path: Path) -> dict[str, str]:
    """The reader's shell after `export NATS_URL=...`, on a stream, subject prefix and lease bucket of this test's own.

    The framework comes from this checkout (PYTHONPATH); the app from the project folder, the current directory.
    Spark runs with the tests' small profile.
    """
    tag = uuid.uuid4().hex[:10]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JETSOURCING_", "PYSPARK_GATEWAY_"))}
    env.update({
        "NATS_URL": nats_url,
        "JETSOURCING_STREAM": f"T{tag}",
        "JETSOURCING_SUBJECT_PREFIX": f"t{tag}",
        "JETSOURCING_LEASE_BUCKET": f"L{tag}",
        "JETSOURCING_SPARK_MASTER": "local[2]",
        "JETSOURCING_SPARK_SHUFFLE_PARTITIONS": "2",
        "JETSOURCING_SPARK_EXTRA_CONF": json.dumps(TEST_PROFILE_CONF),
        "JETSOURCING_SPARK_STARTUP_LOG": str(tmp_path / "spark-startup.log"),
        "PYTHONPATH": str(ROOT),
    })
    return env


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    """The long-running commands a test started: killed at the end if the test left them running."""
    started: list[Process] = []
    yield started
    for process in started:
        process.kill()


def catalogue(database: Path) -> list[tuple[object, ...]]:
    """The read model's rows, or [] while the daemon has not made the table yet."""
    if not database.exists():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        try:
            return db.execute("SELECT library_id, book_id, title, lent_to, times_lent FROM books "
                              "ORDER BY library_id, book_id").fetchall()
        except sqlite3.OperationalError:  # no such table yet
            return []


EXPECTED_ROWS = [
    ("central", "dune", "Dune", None, 1),
    ("central", "emma", "Emma", "ann", 1),
    ("central", "ulysses", "Ulysses", None, 0),
    ("riverside", "middlemarch", "Middlemarch", "bob", 1),
]


@pytest.mark.timeout(600)  # a Spark start on a loaded 2-core machine can take minutes
def test_the_tutorial_runs_as_written(
    project: Path, environment: dict[str, str], processes: list[Process]
) -> None:
    env = environment

    # Step 3: the domain tests.
    tests = run(PYTEST, project, {**env, **READERS_PYTEST})
    assert "5 passed" in tests.stdout, tests.stdout

    # Step 4: the application, in-process, against the server; run again, it stores nothing new.
    assert run(APP, project, env).stdout == APP_OUTPUT
    assert run(APP, project, env).stdout == APP_OUTPUT

    # Step 5: the command service in a terminal of its own, and the client script.
    serve = Process(SERVE, project, env)
    processes.append(serve)
    serving = serve.wait_for("serving ")
    assert "cmd.Library.OpenLibrary" in serving and "cmd.Library.ReturnBook" in serving, serving
    assert run(CLIENT, project, env).stdout == CLIENT_OUTPUT
    assert run(CLIENT, project, env).stdout == CLIENT_RESENT, "a resend stores nothing"
    assert serve.stop() == 0, serve.drain()

    # Step 6: the daemon keeps the catalogue; status, the event tail and the report show it.
    daemon = Process(RUN, project, env)
    processes.append(daemon)
    deadline = time.monotonic() + 60
    while catalogue(project / "jetsourcing.sqlite3") != EXPECTED_ROWS:
        assert time.monotonic() < deadline, (catalogue(project / "jetsourcing.sqlite3"), daemon.drain())
        assert daemon.process.poll() is None, f"the daemon exited: {daemon.drain()}"
        time.sleep(0.2)
    status = run(STATUS, project, env).stdout
    row = next(line.split() for line in status.splitlines() if line.startswith("catalogue "))
    assert row[1:6] == ["running", "1", "1", "10", "10"], status  # state, version, generation, checkpoint, last position
    tail = run(TAIL, project, env).stdout
    assert tail_headers(tail) == TAIL_HEADERS, tail
    assert '"member": "bob"' in tail and '"title": "Middlemarch"' in tail, tail
    assert run(REPORT, project, env).stdout == CATALOGUE
    assert daemon.stop() == 0, daemon.drain()
    assert any("catalogue: stopped -- checkpoint 10" in line for line in daemon.output), daemon.output

    # Step 7: the same projection rebuilt by Spark into Delta, read back with the deltalake package.
    rebuild = run(REBUILD, project, env, timeout_s=240).stdout
    assert "catalogue: rebuild, positions 1 to 10, 8 events folded" in rebuild, rebuild
    assert rebuild.endswith("  books: committed, table version 0, 4 rows written\n"), rebuild
    assert (project / "lake" / "books" / "_delta_log").is_dir()
    assert run(LAKE, project, env).stdout == CATALOGUE


def test_a_broken_rule_fails_its_test_as_the_page_shows(project: Path, environment: dict[str, str]) -> None:
    domain = project / "library" / "domain.py"
    lines = domain.read_text().splitlines(keepends=True)
    check = next(i for i, line in enumerate(lines) if line.strip() == "if held >= self.state.loan_limit:")
    assert lines[check + 1].strip().startswith("raise LoanLimitReached(")
    domain.write_text("".join(lines[:check] + lines[check + 2:]))  # what step 3 asks the reader to remove
    done = subprocess.run(argv(PYTEST), cwd=project, env={**environment, **READERS_PYTEST}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and "1 failed, 4 passed" in done.stdout, done.stdout + done.stderr
    error = next(line for line in done.stdout.splitlines() if line.startswith("E   "))
    assert error == ("E       AssertionError: The command recorded [BookLent(book_id='ulysses', member='ann')] instead "
                     "of raising LoanLimitReached."), done.stdout
    assert error in (PAGES / "testing.md").read_text()
    assert "aggregates/testing.py" not in done.stdout, "the report stops at the reader's test"


def test_jetsourcing_server_serves_the_app(project: Path, environment: dict[str, str], processes: list[Process]) -> None:
    # Step 1's command on a free port (4222 may be taken on this machine), then step 4's app against it.
    port = _free_port()
    server = Process(f"{SERVER} --port {port} --storage-dir nats", project, environment)
    processes.append(server)
    url = f"nats://127.0.0.1:{port}"
    assert server.wait_for("export NATS_URL=").strip() == f"export NATS_URL={url}"
    assert run(APP, project, {**environment, "NATS_URL": url}).stdout == APP_OUTPUT
    assert server.stop() == 0, server.drain()
    assert (project / "nats").is_dir(), "the events are kept in the storage directory"


def _page_lines() -> set[str]:
    lines = set()
    for page in PAGES.glob("*.md"):
        for line in page.read_text().splitlines():
            lines.add(line.split("  #")[0].rstrip())  # a command, without the comment after it
    return lines


@pytest.mark.parametrize("command", COMMANDS)
def test_the_pages_give_the_commands_the_test_runs(command: str) -> None:
    assert command in _page_lines(), f"no page of docs/tutorial gives `{command}` on a line of its own"


@pytest.mark.parametrize("output", [APP_OUTPUT, CLIENT_OUTPUT, CATALOGUE], ids=["app", "client", "catalogue"])
def test_the_pages_show_the_outputs_the_test_checks(output: str) -> None:
    assert any(output in page.read_text() for page in PAGES.glob("*.md")), output


def test_the_pages_show_the_event_tail_the_test_checks() -> None:
    page = (PAGES / "read-model.md").read_text()
    assert tail_headers(page) == TAIL_HEADERS

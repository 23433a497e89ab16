"""The documentation site builds in strict mode, and a broken reference fails the build.

Strict mode turns mkdocs' warnings into errors: a link to a missing page or anchor, a missing
included file (the tutorial's and the examples' code), an API name the reference cannot resolve.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("eventstore", "aggregates", "projections", "spark_projections")


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_site_builds_strictly_with_every_page_and_the_api_reference(tmp_path: Path) -> None:
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    pages = {str(page.relative_to(ROOT / "docs")) for page in (ROOT / "docs").rglob("*.md")}
    built = {str(page.relative_to(tmp_path / "site")) for page in (tmp_path / "site").rglob("index.html")}
    assert {page.removesuffix(".md").removesuffix("index").rstrip("/") + "/index.html" for page in pages} - {
        "/index.html"
    } <= built | {"index.html"}
    reference = (tmp_path / "site" / "reference" / "api" / "eventstore" / "index.html").read_text()
    assert 'id="eventstore.EventStore.append"' in reference  # generated from the docstrings
    assert "Append events to one entity" in reference or "expected_version" in reference


@pytest.mark.parametrize(
    "breakage",
    [
        ("concepts/aggregates.md", "See [the missing page](nowhere.md)."),
        ("concepts/aggregates.md", "See [a missing section](event-store.md#no-such-section)."),
        ("concepts/aggregates.md", '```python\n--8<-- "examples/no_such_file.py"\n```'),
        ("reference/api/eventstore.md", "::: eventstore.NoSuchThing"),
    ],
    ids=["page", "anchor", "included-file", "api-name"],
)
def test_a_broken_reference_fails_the_build(tmp_path: Path, breakage: tuple[str, str]) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    for package in PACKAGES:
        (tmp_path / package).symlink_to(ROOT / package)
    page, text = breakage
    with (tmp_path / "docs" / page).open("a") as file:
        file.write(f"\n\n{text}\n")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "WARNING" in done.stderr or "ERROR" in done.stderr, done.stderr  # it says what is broken

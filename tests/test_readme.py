"""The README's code runs as written (against the session's server)."""

from __future__ import annotations

import re
import textwrap
import uuid
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("block", python_blocks())
async def test_readme_python_block_runs(block: str, nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_URL", nats_url)
    tag = uuid.uuid4().hex[:8]
    monkeypatch.setenv("JETSOURCING_STREAM", f"README{tag}")
    monkeypatch.setenv("JETSOURCING_SUBJECT_PREFIX", f"readme{tag}")
    source = "async def _readme_main():\n" + textwrap.indent(block, "    ") + "\n    return locals()\n"
    namespace: dict[str, object] = {}
    exec(compile(source, str(README), "exec"), namespace)
    final = await namespace["_readme_main"]()  # type: ignore[operator]
    assert final  # the block ran to its end

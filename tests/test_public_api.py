"""Each package's public surface: exported names exist, are listed in order, and say what they guarantee."""

from __future__ import annotations

import importlib
import inspect

import pytest

PACKAGES = ["eventstore", "eventstore.jetstream", "aggregates", "projections", "spark_projections"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_complete(name: str) -> None:
    package = importlib.import_module(name)
    exported = list(package.__all__)
    assert exported == sorted(exported), f"{name}.__all__ is not in alphabetical order"
    missing = [n for n in exported if not hasattr(package, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_class_and_function_has_a_docstring(name: str) -> None:
    package = importlib.import_module(name)
    undocumented = [
        n
        for n in package.__all__
        if (inspect.isclass(obj := getattr(package, n)) or inspect.isfunction(obj)) and not inspect.getdoc(obj)
    ]
    assert not undocumented, f"{name}: public names without a docstring: {undocumented}"


def test_eventstore_imports_none_of_the_other_layers() -> None:
    import ast
    from pathlib import Path

    root = Path(importlib.import_module("eventstore").__file__ or "").parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for module in modules:
                    assert module.split(".")[0] not in {"aggregates", "projections", "spark_projections", "samples"}, (
                        f"{path.name} imports {module}: eventstore must not depend on the layers above it"
                    )
                    # Spark's types meet the event store only through the replay's scanner interface.
                    assert module.split(".")[0] not in {"pyspark", "pyarrow", "pandas", "numpy", "delta"}, (
                        f"{path.name} imports {module}: the event store installs without Spark"
                    )


def test_the_jetstream_wire_is_spelled_in_one_place() -> None:
    """API subjects and error codes live in eventstore/jetstream/api.py, header names in eventstore/wire.py."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    allowed = {root / "eventstore" / "wire.py", root / "eventstore" / "jetstream" / "api.py"}
    header = re.compile(r"(Nats|Es)-[A-Za-z-]+:?")
    from eventstore.jetstream import ErrorCode

    codes = {v for k, v in vars(ErrorCode).items() if k.isupper()}
    found = []
    for package in ("eventstore", "aggregates", "projections", "spark_projections", "samples"):
        for path in sorted((root / package).rglob("*.py")):
            if path in allowed:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                value = node.value if isinstance(node, ast.Constant) else None
                if isinstance(value, bytes):
                    value = value.decode(errors="replace")
                if (
                    (isinstance(value, str) and (value.startswith("$JS.") or header.fullmatch(value)))
                    or (isinstance(value, int) and not isinstance(value, bool) and value in codes)
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {value!r}")
        for path in sorted((root / package).rglob("*.c")):
            found += [f"{path.relative_to(root)}: {m.group()}" for m in re.finditer(r'"(\$JS|Nats-|Es-)[^"]*"', path.read_text())]
    assert not found, "spelled outside eventstore/wire.py and eventstore/jetstream/api.py:\n" + "\n".join(found)

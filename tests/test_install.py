"""``pip install .`` without extras: the event store, aggregates and projections, no Spark and no demo code.

A fresh virtualenv gets the package as a user installs it (a wheel built from a
copy of this checkout, without extras), then imports it in a new process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent(
    """
    import importlib.util, json
    import eventstore, aggregates, projections
    from eventstore import native
    heavy = [m for m in ("pyspark", "delta", "pyarrow", "pandas") if importlib.util.find_spec(m)]
    try:
        import spark_projections
        spark = "imported"
    except ImportError as exc:
        spark = str(exc)
    samples = importlib.util.find_spec("samples") is not None
    import pathlib
    untyped = [p for p in ("eventstore", "aggregates", "projections", "spark_projections")  # found, not imported
               if not pathlib.Path(importlib.util.find_spec(p).origin).with_name("py.typed").is_file()]
    print(json.dumps({"heavy": heavy, "native": native.ACTIVE, "spark": spark, "samples": samples, "untyped": untyped}))
    """
)


def test_the_core_installs_and_imports_without_spark(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "*.so", "__pycache__", ".pytest_cache",
                                      ".mypy_cache", "spark-warehouse"),
    )
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(source)],
        capture_output=True, text=True, timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what the install brought
    checked = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env=clean)
    assert checked.returncode == 0, checked.stderr[-3000:]
    found = json.loads(checked.stdout.splitlines()[-1])
    assert found["heavy"] == [], f"the core install brought {found['heavy']}"
    assert found["samples"] is False, "the demo's code was installed as a top-level 'samples' package"
    assert found["untyped"] == [], f"installed without their py.typed marker: {found['untyped']}"  # PEP 561
    assert found["native"] == "native", found["native"]  # the accelerator's abi3 build came with the wheel
    assert "pip install 'jetsourcing[spark]'" in found["spark"], found["spark"]
    cli = subprocess.run([str(env_dir / "bin" / "jetsourcing"), "--help"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "rebuild" in cli.stdout and "serve" in cli.stdout, cli.stderr
    spark_cli = subprocess.run([str(env_dir / "bin" / "jetsourcing"), "spark", "check"], capture_output=True,
                               text=True, timeout=60)
    lines = spark_cli.stderr.splitlines()
    assert spark_cli.returncode == 1 and len(lines) == 1, spark_cli.stderr
    assert lines[0].startswith("jetsourcing: ") and "pip install 'jetsourcing[spark]'" in lines[0], lines
    wheel_tags = subprocess.run(
        [str(python), "-c", "import eventstore._native as n; print(n.__file__)"], capture_output=True, text=True,
        cwd=tmp_path,
    )
    assert wheel_tags.stdout.strip().endswith(".abi3.so"), wheel_tags.stdout + wheel_tags.stderr

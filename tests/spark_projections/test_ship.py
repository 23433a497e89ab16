"""What jetsourcing ships to the executors (the user's own, uninstalled code; never what is installed), once per
Spark application, unless told not to. The preflight checks are in test_executors.py, the cluster in test_cluster.py."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pydantic
import pytest
from pyspark.sql import SparkSession

from projections import Projection
from spark_projections.ship import SHIP_CODE_CONF, ship_code, shipped_from


def make_package(root: Path, name: str) -> None:
    (root / name / "sub").mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "sub" / "__init__.py").write_text("")
    (root / name / "sub" / "views.py").write_text("class View:\n    pass\n\ndef build():\n    return 1\n")
    (root / name / "sub" / "__pycache__").mkdir()
    (root / name / "sub" / "__pycache__" / "views.cpython-311.pyc").write_bytes(b"stale")


@pytest.fixture
def user_package(tmp_path: Path) -> object:
    """A package of the user's, importable but not installed; forgotten afterwards."""
    name = f"userpkg_{tmp_path.name[-8:].replace('-', '_')}"
    make_package(tmp_path, name)
    sys.path.insert(0, str(tmp_path))
    try:
        module = __import__(f"{name}.sub.views", fromlist=["View"])
        yield module
    finally:
        sys.path.remove(str(tmp_path))
        for key in [k for k in sys.modules if k.split(".")[0] == name]:
            del sys.modules[key]


def test_the_users_top_level_package_is_shipped_and_installed_code_is_not(user_package: object) -> None:
    view = user_package.View()  # type: ignore[attr-defined]
    found = shipped_from([view, user_package.build, pydantic.BaseModel, Projection, len, SimpleNamespace])  # type: ignore[attr-defined]
    top = type(view).__module__.split(".")[0]
    assert list(found) == [top]  # once, as the folder of its top-level package
    assert found[top].is_dir() and (found[top] / "__init__.py").exists()


def test_a_single_module_is_shipped_as_its_file(tmp_path: Path) -> None:
    (tmp_path / "solo_module_x.py").write_text("class A:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import solo_module_x

        assert shipped_from([solo_module_x.A]) == {"solo_module_x": tmp_path / "solo_module_x.py"}
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("solo_module_x", None)


def test_shipping_zips_the_package_once_per_application_and_can_be_turned_off(
    spark: SparkSession, user_package: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    added: list[str] = []
    monkeypatch.setattr(spark.sparkContext, "addPyFile", added.append)  # record instead of adding to the session
    view = user_package.View()  # type: ignore[attr-defined]
    top = type(view).__module__.split(".")[0]
    spark.conf.set(SHIP_CODE_CONF, "false")
    try:
        assert ship_code(spark, [view]) == [] and added == []
    finally:
        spark.conf.unset(SHIP_CODE_CONF)
    assert ship_code(spark, [view]) == [top]
    assert ship_code(spark, [view, user_package.build]) == []  # type: ignore[attr-defined] # shipped already
    [archive] = added
    with zipfile.ZipFile(archive) as zipped:
        names = sorted(zipped.namelist())
    assert names == [f"{top}/__init__.py", f"{top}/sub/__init__.py", f"{top}/sub/views.py"]  # no compiled files


@pytest.mark.parametrize(("value", "conf"), [(None, "true"), ("false", "false"), ("0", "false"), ("true", "true")])
def test_the_setting_becomes_the_sessions_conf(value: str | None, conf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from spark_projections.session import _conf
    from spark_projections.settings import SparkSettings

    if value is not None:
        monkeypatch.setenv("JETSOURCING_SPARK_SHIP_CODE", value)
    assert _conf(SparkSettings(), {})[SHIP_CODE_CONF] == conf

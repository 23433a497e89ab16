"""Finding user code by import path (``module:attr``): what the command lines take projections as."""

from __future__ import annotations

import importlib
import os
import sys

from .errors import ProjectionLoadError
from .projection import Projection

__all__ = ["import_object", "load_projection"]


def import_object(path: str) -> object:
    """Import ``module:attr`` (the current directory is importable) and return the attribute.

    Raises :class:`ProjectionLoadError` saying what is wrong with the path.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ProjectionLoadError(f"{path!r} is not an import path; write it as 'package.module:ProjectionClass'.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ProjectionLoadError(f"Cannot import {module_name!r} (from {path!r}): {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ProjectionLoadError(f"Module {module_name!r} has no attribute {attr!r} (from {path!r}).") from None


def load_projection(path: str) -> Projection:
    """Import ``module:Class`` (or ``module:instance``) and return a projection instance."""
    obj = import_object(path)
    if isinstance(obj, Projection):
        return obj
    if isinstance(obj, type) and issubclass(obj, Projection):
        return obj()
    raise ProjectionLoadError(f"{path!r} is {obj!r}, not a Projection subclass or instance.")

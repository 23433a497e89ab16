"""Finding user code by import path (``module:attr``): what every command line takes user code as."""

from __future__ import annotations

import importlib
import os
import sys

from .errors import ImportPathError

__all__ = ["import_object"]


def import_object(path: str) -> object:
    """Import ``module:attr`` (the current directory is importable) and return the attribute.

    Raises :class:`ImportPathError` saying what is wrong with the path.
    """
    module_name, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ImportPathError(f"{path!r} is not an import path; write it as 'package.module:name'.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportPathError(f"Cannot import {module_name!r} (from {path!r}): {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportPathError(f"Module {module_name!r} has no attribute {attr!r} (from {path!r}).") from None

"""Loading a projection named by import path (``module:Class``), as the command lines take it."""

from __future__ import annotations

from eventstore import ImportPathError, import_object

from .errors import ProjectionLoadError
from .projection import Projection

__all__ = ["load_projection"]


def load_projection(path: str) -> Projection:
    """Import ``module:Class`` (or ``module:instance``) and return a projection instance.

    Raises :class:`ProjectionLoadError` saying what is wrong with the path or the object.
    """
    try:
        obj = import_object(path)
    except ImportPathError as exc:
        raise ProjectionLoadError(str(exc)) from exc
    if isinstance(obj, Projection):
        return obj
    if isinstance(obj, type) and issubclass(obj, Projection):
        return obj()
    raise ProjectionLoadError(f"{path!r} is {obj!r}, not a Projection subclass or instance.")

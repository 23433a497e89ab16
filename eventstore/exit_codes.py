"""The exit codes every ``jetsourcing`` command uses, and their table in each command's ``--help``.

One table for all of them: the commands of :mod:`projections.cli` and the ones it runs through the
``jetsourcing.commands`` entry points (``events``, ``entity``, ``server`` here, ``serve``, ``spark``).
It lives in the lowest package so that each can take it from here: the event store imports none of
the others.
"""

from __future__ import annotations

import argparse

__all__ = ["FAILURE", "INTERRUPTED", "SUCCESS", "TERMINATED", "USAGE", "add_exit_codes"]

SUCCESS = 0
FAILURE = 1
"""A failure the command explains in its last line on stderr (what went wrong and what to do)."""
USAGE = 2
"""A usage error: arguments, settings or import paths that cannot be used (argparse's own code too)."""
INTERRUPTED = 130
"""Stopped by Ctrl-C (SIGINT): 128 + 2, as shells report it."""
TERMINATED = 143
"""Stopped by SIGTERM: 128 + 15."""


def add_exit_codes(parser: argparse.ArgumentParser, *, runs_until_stopped: bool = False) -> None:
    """Show the exit-code table in ``parser``'s ``--help``, a section of its own after the options.

    ``runs_until_stopped``: the command's work is to run until it is told to stop (``run``, ``serve``,
    ``server``, ``spark follow``), so SIGTERM is how it ends normally: it exits 0 then.
    """
    sigterm = (f"{SUCCESS} also after SIGTERM, its normal stop (a stop forced by a second signal: 128 + its number)"
               if runs_until_stopped else f"{TERMINATED} stopped by SIGTERM")
    parser.add_argument_group(
        "exit codes",
        f"{SUCCESS} success; {FAILURE} failure (the last line on stderr says what is wrong and what to do); "
        f"{USAGE} usage error (arguments, settings, import paths); {INTERRUPTED} interrupted by Ctrl-C; {sigterm}.",
    )

"""The ``jetsourcing`` command: run, rebuild and inspect projections.

::

    jetsourcing run myapp.views:AccountBalances myapp.views:Orders --db views.sqlite3
    jetsourcing run myapp.views:AccountBalances --until-caught-up     # burst mode: catch up, exit 0
    jetsourcing rebuild myapp.views:AccountBalances                    # replay into a shadow, switch
    jetsourcing rebuild myapp.views:AccountBalances --resume           # go on after an interrupted one
    jetsourcing status [--json]
    jetsourcing dead-letters list                                      # projections' and reactors' dead letters
    jetsourcing dead-letters retry myapp.reactors:mailer --all         # run a reactor again on its dead letters
    jetsourcing dead-letters drop --projection balances --position 1042
    jetsourcing serve myapp.commands:service                           # commands over NATS (aggregates.cli)
    jetsourcing spark rebuild myapp.views:AccountBalances --root DIR   # Spark and Delta (spark_projections.cli)

``serve`` and ``spark`` are the other packages' commands, found through the
``jetsourcing.commands`` entry points (so this package imports neither):
each is a ``main(argv)`` run with the arguments after its name.

Projections are named by import path ``module:Class`` (the current directory
is importable). The server comes from ``NATS_URL`` or ``--nats-url``; every
setting can also be given as ``JETSOURCING_<FIELD>`` (see
:class:`~projections.settings.ProjectionSettings`). Exit codes: 0 success
(also when a reader of the output, such as ``head``, stopped reading), 1 a
projection stopped with an error, a rebuild failed or the server could not
be used, 2 usage errors (arguments, settings, import paths), 130 after
Ctrl-C, 128 + the signal's number when a stop had to be forced or a signal
left a rebuild unfinished (143 after SIGTERM; ``run`` and ``serve``, whose
work is to run until stopped, exit 0 after SIGTERM).
Every error ends the command with one line ``jetsourcing: <what is wrong and
what to do>`` on stderr (an unreachable server within the request timeout);
``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import logging
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version
from typing import Any

from pydantic import ValidationError

from eventstore import EventStoreError, EventStoreSettings, ImportPathError
from eventstore.exit_codes import add_exit_codes
from eventstore.security import redact_url

from .daemon import SignalShutdown, run_daemon
from .dead_letter_commands import (
    PROJECTION_RETRY,
    drop_dead_letters,
    format_dead_letters,
    read_dead_letters,
    retry_dead_letters,
)
from .errors import ProjectionError, ProjectionLoadError, RebuildError
from .loading import load_projection
from .logs import configure_logging
from .metrics import serve_metrics
from .progress import progress_for
from .projection import ErrorPolicy, Projection
from .rebuild import RebuildResult, rebuild
from .settings import ProjectionSettings
from .reactors import format_reactor_status
from .status import format_status, read_statuses
from .watch import watch_status

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", help="the read models: a SQLite file or a postgresql:// URL (JETSOURCING_DATABASE)")
    common.add_argument("--nats-url", help="NATS server URL(s) (NATS_URL)")
    common.add_argument("--stream", help="JetStream stream of the events (JETSOURCING_STREAM)")
    common.add_argument("--subject-prefix", help="subject prefix of the events (JETSOURCING_SUBJECT_PREFIX)")
    common.add_argument("--lease-bucket", help="KV bucket of the leases (JETSOURCING_LEASE_BUCKET)")
    _add_global_options(common)

    parser = argparse.ArgumentParser(
        prog="jetsourcing", description="Run jetsourcing: projections, command services, Spark.",
        epilog="examples: jetsourcing run myapp.views:Balances | jetsourcing status | "
        "jetsourcing serve myapp.commands:service | jetsourcing spark check",
    )
    parser.add_argument("--version", action="version", version=f"jetsourcing {_version()}")
    add_exit_codes(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in _plugins():  # listed for --help; run by main before parsing
        commands.add_parser(name, add_help=False, help=f"(see jetsourcing {name} --help)")

    run = commands.add_parser(
        "run", parents=[common], help="catch up, then keep the read models up to date",
        description="The projection daemon: apply each projection's events to its read model (SQLite, or PostgreSQL "
        "with JETSOURCING_DATABASE), catching up from its checkpoint, then following the stream live, each batch "
        "applied exactly once. Runs until SIGTERM or Ctrl-C; a second daemon waits and takes over if this one dies.",
        epilog="examples: jetsourcing run myapp.views:Balances myapp.views:Orders --db views.sqlite3 | "
        "jetsourcing run myapp.views:Balances --until-caught-up --log-format json --metrics-port 9100",
    )
    add_exit_codes(run, runs_until_stopped=True)
    run.add_argument("projections", nargs="+", metavar="module:Class",
                     help="the projections to run, as import paths from the current directory, e.g. myapp.views:Balances")
    run.add_argument("--until-caught-up", action="store_true",
                     help="burst mode: catch up to the stream's last position at start, then exit")
    run.add_argument("--error-policy", choices=[p.value for p in ErrorPolicy],
                     help="override every projection's error policy")
    run.add_argument("--batch-size", type=int, help="events per batch (JETSOURCING_BATCH_SIZE)")

    reb = commands.add_parser(
        "rebuild", parents=[common], help="replay into a shadow copy and switch readers to it",
        description="Replay the whole stream from its first event into a new copy of the projection's tables while "
        "the current one stays readable, then switch the readers to it in one transaction. An interrupted "
        "rebuild leaves the old model live and keeps what it built for --resume.",
        epilog="examples: jetsourcing rebuild myapp.views:Balances | jetsourcing rebuild myapp.views:Balances --resume",
    )
    add_exit_codes(reb)
    reb.add_argument("projection", metavar="module:Class",
                     help="the projection to rebuild, as an import path from the current directory")
    reb.add_argument("--batch-size", type=int, help="events per batch (JETSOURCING_REBUILD_BATCH_SIZE)")
    reb.add_argument("--error-policy", choices=[p.value for p in ErrorPolicy])
    reb.add_argument("--resume", action="store_true",
                     help="go on with the shadow an interrupted rebuild of this version kept (default: start over)")

    status = commands.add_parser(
        "status", parents=[common], help="checkpoints, lag and state of every projection, and the reactors",
        description="What every projection's read model has reached (checkpoint, lag behind the stream, state), "
        "and every reactor's consumer (pending, redeliveries, dead letters). Needs no domain code.",
        epilog="examples: jetsourcing status | jetsourcing status --json | jetsourcing status --watch 1",
    )
    dead = commands.add_parser(
        "dead-letters", parents=[common], help="the projections' and reactors' dead letters: list, retry, drop",
        epilog="examples: jetsourcing dead-letters list | jetsourcing dead-letters retry myapp.reactors:mailer "
        "--position 1042 | jetsourcing dead-letters drop --projection balances --position 1042 | "
        "jetsourcing dead-letters drop --reactor mailer --all",
    )
    add_exit_codes(status)
    add_exit_codes(dead)
    dead.add_argument("action", choices=["list", "retry", "drop"])
    dead.add_argument("code", nargs="?", metavar="module:reactor",
                      help="retry: the reactor whose handlers run again on its dead letters")
    dead.add_argument("--projection", help="drop: the projection's dead letters (its name)")
    dead.add_argument("--reactor", help="drop: the reactor's dead letters (its name)")
    dead.add_argument("--position", type=int, help="retry, drop: the dead letters of the commit at this position")
    dead.add_argument("--all", action="store_true", help="retry, drop: every dead letter of the reactor (or projection)")
    dead.add_argument("--json", action="store_true", help="list: print JSON instead of a table")

    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--watch", nargs="?", const=2.0, type=float, metavar="SECONDS",
                        help="a live table, refreshed every SECONDS (default 2) until Ctrl-C")
    return parser


def _settings(args: argparse.Namespace) -> ProjectionSettings:
    es: dict[str, Any] = {}
    for option, field in (("nats_url", "nats_url"), ("stream", "stream"), ("subject_prefix", "subject_prefix")):
        if getattr(args, option, None):
            es[field] = getattr(args, option)
    values: dict[str, Any] = {"eventstore": EventStoreSettings(**es)}
    if args.db:
        values["database"] = args.db
    if args.lease_bucket:
        values["lease_bucket"] = args.lease_bucket
    if getattr(args, "error_policy", None):
        values["error_policy"] = args.error_policy
    if getattr(args, "batch_size", None) is not None:  # 0 too: the settings refuse it, as from the environment
        values["rebuild_batch_size" if args.command == "rebuild" else "batch_size"] = args.batch_size
    return ProjectionSettings(**values)


def _rebuild_until_signal(projection: Projection, settings: ProjectionSettings, resume: bool) -> RebuildResult:
    """Rebuild; SIGINT/SIGTERM stop it cleanly (readers keep the old model; the shadow is kept for --resume), a
    second signal or ``shutdown_timeout_s`` cancels it (see :class:`SignalShutdown`). A rebuild a signal stopped
    ends the process with 128 + the signal's number (130 after Ctrl-C), as an interrupted command does."""
    stop = asyncio.Event()
    shutdown = SignalShutdown(stop.set, settings.shutdown_timeout_s)
    try:
        return shutdown.run(rebuild(projection, settings, progress=progress_for(f"rebuild {projection.name}"),
                                    stop=stop, resume=resume))
    except asyncio.CancelledError:
        raise SystemExit(shutdown.exit_code) from None
    except RebuildError as exc:
        if shutdown.first_signal is None:
            raise
        print(f"jetsourcing: {exc}", file=sys.stderr)
        raise SystemExit(128 + shutdown.first_signal.value) from None


def _add_global_options(parser: argparse.ArgumentParser) -> None:
    """The options every command takes, ``serve`` and ``spark`` too (they are taken off before those run)."""
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="log lines as text, or as one JSON object each (for log collectors)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus metrics at http://ADDR:PORT/metrics while the command runs")
    parser.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                        help="the address the metrics are served on (default 127.0.0.1; 0.0.0.0 for every interface, "
                        "e.g. in a container)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error, not only its message")


def _start(args: argparse.Namespace) -> None:
    """Logging and the metrics endpoint, as the global options say."""
    configure_logging(args.log_level, args.log_format)
    if args.metrics_port is not None:
        serve_metrics(args.metrics_port, args.metrics_addr)


def _version() -> str:
    try:
        return version("jetsourcing")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree that was never installed
        return "unknown"


_BUILT_IN = frozenset({"run", "rebuild", "status", "dead-letters"})


def _plugins() -> dict[str, EntryPoint]:
    # A package cannot take over a built-in command (nor break this parser by naming one twice).
    return {e.name: e for e in entry_points(group="jetsourcing.commands") if e.name not in _BUILT_IN}


def _run_plugin(entry: EntryPoint, argv: list[str]) -> int:
    """Run another package's command with the global options and the same error handling (one line; the
    traceback with --debug)."""
    options = argparse.ArgumentParser(prog=f"jetsourcing {entry.name}", add_help=False)
    _add_global_options(options)
    args, rest = options.parse_known_args(argv)
    try:
        _start(args)
        command = entry.load()
        if {"-h", "--help"} & set(rest):
            try:
                return int(command(rest))
            finally:  # after the command's own help: the options taken off before it ran
                listed = argparse.ArgumentParser(usage=argparse.SUPPRESS, add_help=False)
                _add_global_options(listed)
                print("\n" + listed.format_help().replace("options:", "options of every jetsourcing command:", 1))
        return int(command(rest))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_gone()
    except (ImportPathError, ValidationError) as exc:
        return _fail(args, exc, 2)
    except (EventStoreError, ImportError) as exc:
        return _fail(args, exc, 1)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback (unless --debug)
        ours = type(exc).__module__.split(".")[0] in {"aggregates", "spark_projections", "projections", "eventstore"}
        return _fail(args, exc, 1, "" if ours else f"unexpected {type(exc).__name__}: ")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jetsourcing`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = _plugins()
    if argv and argv[0] in plugins:
        return _run_plugin(plugins[argv[0]], argv[1:])
    args = _parser().parse_args(argv)
    try:
        _start(args)
        settings = _settings(args)
        if args.command == "run":
            projections = [load_projection(p) for p in args.projections]
            return run_daemon(projections, settings, until_caught_up=args.until_caught_up)
        if args.command == "rebuild":
            projection = load_projection(args.projection)
            result = _rebuild_until_signal(projection, settings, args.resume)
            print(f"{result.projection}: generation {result.generation} is live at checkpoint {result.checkpoint} "
                  f"({result.events} events in {result.seconds:.1f}s, {result.events_per_s:,.0f} events/s, "
                  f"{result.dead_lettered} dead-lettered)")
            return 0
        if args.command == "dead-letters":
            return _dead_letters(args, settings)
        if args.watch is not None:
            return asyncio.run(watch_status(settings, args.watch))
        statuses, reactors = asyncio.run(read_statuses(settings))
        if args.json:
            print(json.dumps({"projections": [s.as_dict() for s in statuses],
                              "reactors": None if reactors is None else [r.as_dict() for r in reactors]}, indent=2))
        else:
            print(format_status(statuses))
            if reactors:
                print("\n" + format_reactor_status(reactors))
        if reactors is None:  # what the read models say is shown; what only the server knows is not
            url = redact_url(settings.eventstore.nats_url or "") or "(no NATS_URL set)"
            print(f"jetsourcing: NATS at {url} could not be asked: the lag and the "
                  "reactors are unknown (shown as ?). Check NATS_URL and that the server runs.", file=sys.stderr)
            return 1
        return 0
    except (ProjectionLoadError, ValidationError) as exc:
        return _fail(args, exc, 2)
    except (ProjectionError, EventStoreError) as exc:
        return _fail(args, exc, 1)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_gone()
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback (unless --debug)
        return _fail(args, exc, 1, f"unexpected {type(exc).__name__}: ")


def _dead_letters(args: argparse.Namespace, settings: ProjectionSettings) -> int:
    if args.action == "list":
        entries, missing = asyncio.run(read_dead_letters(settings))
        if args.json:
            print(json.dumps({"dead_letters": [e.as_dict() for e in entries], "not_read": missing}, indent=2))
        else:
            print(format_dead_letters(entries))
            if missing:
                print(f"(not shown: {missing})")
        return 0
    if args.action == "retry" and args.projection is not None:
        raise ProjectionError(PROJECTION_RETRY)
    if (args.position is None) == (not args.all):
        raise ProjectionError(f"{args.action} needs --position P (one commit's dead letters) or --all, not both.")
    if args.action == "retry":
        result = asyncio.run(retry_dead_letters(settings, reactor=args.code,
                                                position=None if args.all else args.position))
        for position, error in result.failed:
            print(f"position {position}: failed again, the dead letter stays: {error}")
        print(f"retried {len(result.retried)} dead letter(s) of reactor {args.code}: handled and deleted; "
              f"{len(result.failed)} failed again")
        return 1 if result.failed else 0
    dropped = asyncio.run(drop_dead_letters(settings, projection=args.projection, reactor=args.reactor,
                                            position=None if args.all else args.position))
    print(f"dropped {dropped} dead letter(s) of {'projection' if args.projection else 'reactor'} "
          f"{args.projection or args.reactor}")
    return 0


def _fail(args: argparse.Namespace, exc: Exception, code: int, kind: str = "") -> int:
    """Report ``exc`` as one line on stderr (and its traceback with --debug); return the exit code."""
    if args.debug:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, ValidationError):  # pydantic's own text spans several lines
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "a setting"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        text = f"invalid setting {where}: {first['msg']} (given {first.get('input')!r}){more}."
    else:
        text = str(exc)
    print(f"jetsourcing: {kind}{text}", file=sys.stderr)
    return code


def _reader_gone() -> int:
    """Whoever read our output stopped (``| head``): nothing more to say, and nothing to complain about."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at the interpreter's exit
    return 0


if __name__ == "__main__":
    sys.exit(main())

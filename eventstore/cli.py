"""``jetsourcing events`` and ``jetsourcing entity``: look at the stored events from a shell.

::

    jetsourcing events tail                          # the last 10 positions, then follow live (Ctrl-C ends)
    jetsourcing events tail --category Account -n 500 --no-follow
    jetsourcing events tail --category Account --entity alice --json
    jetsourcing entity show Account alice            # one entity's history, with versions

Payloads are shown as stored (JSON), so no domain code needs to be importable.
The ``jetsourcing`` command (``projections.cli``) runs these through the
``jetsourcing.commands`` entry points; errors end it with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from .events import RecordedEvent
from .exit_codes import add_exit_codes
from .settings import EventStoreSettings
from .store import EventStore
from .streams import StreamId

__all__ = ["entity_main", "events_main", "server_settings"]


def _command(
    name: str, description: str, examples: str, sub: str, sub_help: str, sub_examples: str
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``jetsourcing <name> <sub>``: the command's parser and its one sub-command's, each with the exit codes."""
    parser = argparse.ArgumentParser(prog=f"jetsourcing {name}", description=description, epilog=examples)
    add_exit_codes(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser(sub, help=sub_help, epilog=sub_examples)
    add_exit_codes(command)
    return parser, command


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", help="NATS server URL(s) (NATS_URL)")
    parser.add_argument("--stream", help="JetStream stream of the events (JETSOURCING_STREAM)")
    parser.add_argument("--subject-prefix", help="subject prefix of the events (JETSOURCING_SUBJECT_PREFIX)")
    parser.add_argument("--json", action="store_true", help="one JSON object per event and line (for tools)")


def server_settings(nats_url: str | None, stream: str | None, subject_prefix: str | None) -> EventStoreSettings:
    """The event store settings a command line gives (then ``NATS_URL`` and ``JETSOURCING_*``), refusing none
    for the server: a command never starts an embedded server of its own, which would hold nothing."""
    given: dict[str, Any] = {k: v for k, v in (("nats_url", nats_url), ("stream", stream),
                                               ("subject_prefix", subject_prefix)) if v}
    return EventStoreSettings(**given).require_server(
        "A command works on an existing event store; an empty embedded server started here would hold nothing."
    )


def _settings(args: argparse.Namespace) -> EventStoreSettings:
    return server_settings(args.nats_url, args.stream, args.subject_prefix)


def _as_dict(event: RecordedEvent) -> dict[str, Any]:
    try:
        data: Any = json.loads(event.payload)
    except ValueError:
        data = event.payload.decode("utf-8", "replace")
    return {
        "position": event.position, "index": event.index, "stream": str(event.stream_id), "version": event.version,
        "type": event.type, "schema_version": event.schema_version, "event_id": event.event_id,
        "recorded_at": event.recorded_at_text, "correlation_id": event.correlation_id,
        "causation_id": event.causation_id, "data": data,
    }


def _show(event: RecordedEvent, as_json: bool) -> None:
    entry = _as_dict(event)
    if as_json:
        print(json.dumps(entry), flush=True)
        return
    print(f"#{event.position}.{event.index}  {event.stream_id}  v{event.version}  {event.type}"
          f"  {event.recorded_at_text}")
    print("  " + json.dumps(entry["data"], indent=2).replace("\n", "\n  "), flush=True)


def events_main(argv: Sequence[str] | None = None) -> int:
    """``jetsourcing events tail``; returns the exit code."""
    parser, tail = _command(
        "events", "Look at the stream's events.",
        "examples: jetsourcing events tail | jetsourcing events tail --category Account -n 500 --no-follow",
        "tail", "the last positions' events, then follow live",
        "examples: jetsourcing events tail -n 100 | jetsourcing events tail --category Account --entity alice "
        "--json | jetsourcing events tail --from-position 1 --no-follow",
    )
    tail.add_argument("--category", action="append", help="only this category (repeat for more)")
    tail.add_argument("--entity", help="only this entity id (give exactly one --category)")
    tail.add_argument("-n", "--positions", type=int, default=10,
                      help="start this many stream positions back from the end (default 10); with --entity, "
                      "this many of the entity's last events")
    tail.add_argument("--from-position", type=int, help="start at this stream position instead")
    tail.add_argument("--no-follow", action="store_true", help="stop at the stream's end instead of following")
    _connection_options(tail)
    args = parser.parse_args(argv)
    # Usage errors exit 2, as argparse's own do.
    if args.entity is not None and (not args.category or len(args.category) != 1):
        tail.error("--entity needs exactly one --category: an entity id is unique within a category.")
    if args.positions < 0:
        tail.error(f"-n {args.positions}: give 0 or more.")
    if args.from_position is not None and args.from_position < 1:
        tail.error(f"--from-position {args.from_position}: give a stream position, 1 or more.")
    return asyncio.run(_tail(args))


async def _tail(args: argparse.Namespace) -> int:
    async with EventStore.connect(_settings(args), create_stream=False) as store:
        start = args.from_position
        if args.entity is not None:
            stream_id = StreamId(args.category[0], args.entity)
            if start is None:  # the entity's last n events, then what follows them
                history = await store.read(stream_id, consistent=True)
                shown = history[len(history) - args.positions:] if args.positions else []
                for event in shown:
                    _show(event, args.json)
                if args.no_follow:
                    return 0
                start = (history[-1].position + 1) if history else max(1, await store.last_position() + 1)
        elif start is None:
            start = max(1, await store.last_position() - args.positions + 1)
        reading = (store.read_all(from_position=start, categories=args.category) if args.no_follow
                   else store.subscribe(from_position=start, categories=args.category))
        async for batch in reading:
            for event in batch:
                if args.entity is None or event.stream_id.entity_id == args.entity:
                    _show(event, args.json)
    return 0


def entity_main(argv: Sequence[str] | None = None) -> int:
    """``jetsourcing entity show``; returns the exit code."""
    parser, show = _command(
        "entity", "Look at one entity's events.", "example: jetsourcing entity show Account alice",
        "show", "the entity's history, with versions and positions",
        "examples: jetsourcing entity show Account alice | jetsourcing entity show Account alice --json",
    )
    show.add_argument("category")
    show.add_argument("entity_id", metavar="id")
    _connection_options(show)
    args = parser.parse_args(argv)
    return asyncio.run(_entity(args))


async def _entity(args: argparse.Namespace) -> int:
    stream_id = StreamId(args.category, args.entity_id)
    async with EventStore.connect(_settings(args), create_stream=False) as store:
        events = await store.read(stream_id, consistent=True)
    if not events:
        print(f"jetsourcing: {stream_id} has no events in stream {store.settings.stream!r}.", file=sys.stderr)
        return 1
    if not args.json:
        print(f"{stream_id}: {len(events)} events, version {events[-1].version}, last position {events[-1].position}")
    for event in events:
        _show(event, args.json)
    return 0

"""``jetsourcing serve``: run a command service until SIGTERM.

::

    jetsourcing serve samples.bank.commands:command_service
    jetsourcing serve myapp.commands:service --max-in-flight 128 --nats-url nats://nats:4222

The argument names, by import path, a function that takes the connected
:class:`~eventstore.EventStore` and the service's options
(``subject_prefix``, ``queue``, ``max_in_flight``, ``drain_timeout_s``: see
:class:`~aggregates.settings.CommandServiceSettings`) and returns the
:class:`~aggregates.CommandService` to run. Start the same command in more
processes to share the commands (one queue group). SIGTERM or SIGINT drains:
the commands received finish and reply within ``drain_timeout_s``, then the
process exits (0 after SIGTERM, 130 after Ctrl-C); a second signal exits at
once (128 + the signal's number). At start it waits out a JetStream that
elects a leader or loses replies, as the outage policy says
(``JETSOURCING_OUTAGE_LIMIT_S``; by default, for as long as it takes).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any

from eventstore import EventStore, InvalidArgumentError, ServerUnavailableError, import_object
from eventstore.cli import server_settings
from eventstore.exit_codes import add_exit_codes

from .service import CommandService
from .settings import CommandServiceSettings

__all__ = ["main"]

log = logging.getLogger(__name__)


def parser() -> argparse.ArgumentParser:
    """The ``serve`` command's arguments."""
    serve = argparse.ArgumentParser(
        prog="jetsourcing serve", description="Serve an application's commands over NATS until SIGTERM.",
        epilog="example: jetsourcing serve samples.bank.commands:command_service --max-in-flight 128",
    )
    add_exit_codes(serve, runs_until_stopped=True)  # shown after the options
    serve.add_argument("factory", metavar="module:function",
                       help="a function (store, **options) -> CommandService")
    serve.add_argument("--nats-url", help="NATS server URL(s) (NATS_URL)")
    serve.add_argument("--stream", help="JetStream stream of the events (JETSOURCING_STREAM)")
    serve.add_argument("--subject-prefix", help="subject prefix of the events (JETSOURCING_SUBJECT_PREFIX)")
    serve.add_argument("--command-prefix", help="commands' subject prefix (JETSOURCING_COMMAND_SUBJECT_PREFIX)")
    serve.add_argument("--queue", help="queue group (JETSOURCING_COMMAND_QUEUE)")
    serve.add_argument("--max-in-flight", type=int, help="commands run at once (JETSOURCING_COMMAND_MAX_IN_FLIGHT)")
    serve.add_argument("--drain-timeout", type=float, help="seconds a stop may take (JETSOURCING_COMMAND_DRAIN_TIMEOUT_S)")
    serve.add_argument("--partitions", type=int,
                       help="partitions of the aggregate ids, the same for every service of the prefix "
                            "(JETSOURCING_COMMAND_PARTITIONS, default 64)")
    serve.add_argument("--no-routing", dest="routing", action="store_const", const=False,
                       help="share commands at random in the queue group (JETSOURCING_COMMAND_ROUTING=false)")
    return serve


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``serve`` with ``argv``; returns the exit code (errors propagate to the ``jetsourcing`` command)."""
    args = parser().parse_args(argv)
    options: dict[str, Any] = {k: v for k, v in (
        ("subject_prefix", args.command_prefix), ("queue", args.queue), ("max_in_flight", args.max_in_flight),
        ("drain_timeout_s", args.drain_timeout), ("partitions", args.partitions), ("routing", args.routing))
        if v is not None}
    store = server_settings(args.nats_url, args.stream, args.subject_prefix)
    settings = CommandServiceSettings(eventstore=store, **options)
    factory = import_object(args.factory)
    if not callable(factory):
        raise InvalidArgumentError(f"{args.factory!r} is {factory!r:.80}, not a function returning a CommandService.")
    return asyncio.run(_serve(args.factory, factory, settings))


async def _serve(path: str, factory: Any, settings: CommandServiceSettings) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def on_signal(number: int) -> None:
        if received:  # the second signal: do not wait for the drain
            os._exit(128 + number)
        received.append(number)
        log.info("received %s: draining", signal.Signals(number).name)
        stop.set()

    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, on_signal, number)
    try:
        # A long-running process: the stream check waits out an election or lost replies (the outage policy).
        store = await EventStore.connect(settings.eventstore, long_running=True, stop=stop)
    except ServerUnavailableError:
        if received:  # stopped while waiting for the server: nothing was served, nothing to drain
            return 130 if received == [signal.SIGINT] else 0
        raise
    async with store:
        try:
            service = factory(store, **settings.service_options())
        except Exception as exc:
            raise InvalidArgumentError(
                f"{path}(store, **options) raised {type(exc).__name__}: {exc}. It must take the event store and "
                "the service's options (subject_prefix, queue, max_in_flight, drain_timeout_s, routing, partitions, "
                "member_ttl_s) and return a "
                "CommandService."
            ) from exc
        if not isinstance(service, CommandService):
            raise InvalidArgumentError(f"{path}(store, **options) returned {service!r:.80}, not a CommandService.")
        await service.start(long_running=True, stop=stop)  # its snapshot buckets wait out an election too
        async with service:
            lost = store.connection_lost
            waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits:
                    waiting.cancel()
            if lost.is_set() and not stop.is_set():
                raise ServerUnavailableError(
                    "The NATS connection was lost for longer than the outage limit "
                    f"({settings.eventstore.outage_limit_s:g} s, JETSOURCING_OUTAGE_LIMIT_S): stopped serving. "
                    "Restart serve once the server is back, or raise the limit."
                )
    return 130 if received == [signal.SIGINT] else 0

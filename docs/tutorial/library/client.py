"""Send the library commands over NATS, as any other program would: ``python -m library.client``."""

import asyncio

from pydantic import BaseModel

from aggregates import CommandClient, CommandRejectedError
from eventstore import EventStore
from library.domain import Library
from library.service import AddBook, LendBook, OpenLibrary, ReturnBook


async def send(client: CommandClient, library_id: str, command: BaseModel, command_id: str) -> None:
    """Send one command and say how it went."""
    what = f"{type(command).__name__} to {library_id}"
    try:
        reply = await client.send(Library, library_id, command, command_id=command_id)
    except CommandRejectedError as refused:
        print(f"{what}: refused ({refused.error_type}): {refused}")
    else:
        again = " (sent before: nothing new was stored)" if reply.duplicate else ""
        print(f"{what}: done, the library is at version {reply.version}{again}")


async def main() -> None:
    async with EventStore.connect() as store:  # the server in NATS_URL
        client = CommandClient(store)
        await send(client, "riverside", OpenLibrary(name="Riverside Library", loan_limit=1), "open-riverside")
        await send(client, "riverside", AddBook(book_id="middlemarch", title="Middlemarch"), "add-middlemarch")
        await send(client, "riverside", LendBook(book_id="middlemarch", member="bob"), "lend-middlemarch")
        await send(client, "riverside", LendBook(book_id="middlemarch", member="cat"), "lend-middlemarch-2")
        await send(client, "central", ReturnBook(book_id="dune"), "return-dune")


if __name__ == "__main__":
    asyncio.run(main())

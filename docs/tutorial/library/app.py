"""The library's application: its use cases as methods, run in this process.

``python -m library.app`` opens the Central Library on the server in ``NATS_URL``, adds books and lends them.
"""

import asyncio

from aggregates import Application, DomainError
from library.domain import Library, LibraryState


class LibraryApp(Application):
    """The lending library's use cases. Each runs one command on one library through its repository.

    ``command_id`` names a request: a command whose id the library has seen already is not run again.
    """

    async def open_library(self, library_id: str, name: str, loan_limit: int, command_id: str | None = None) -> None:
        # create=True: this command starts a new library, and is refused if library_id exists already.
        await self.repository(Library).execute(
            library_id, lambda lib: lib.open(name, loan_limit), create=True, command_id=command_id
        )

    async def add_book(self, library_id: str, book_id: str, title: str, command_id: str | None = None) -> None:
        await self.repository(Library).execute(library_id, lambda lib: lib.add_book(book_id, title), command_id=command_id)

    async def lend(self, library_id: str, book_id: str, member: str, command_id: str | None = None) -> None:
        await self.repository(Library).execute(library_id, lambda lib: lib.lend(book_id, member), command_id=command_id)

    async def take_back(self, library_id: str, book_id: str, command_id: str | None = None) -> None:
        await self.repository(Library).execute(library_id, lambda lib: lib.take_back(book_id), command_id=command_id)

    async def state(self, library_id: str) -> LibraryState:
        """The library as its events tell it, read from the event store."""
        return (await self.repository(Library).get(library_id)).state


async def main() -> None:
    async with LibraryApp.connect() as app:  # the server in NATS_URL
        await app.open_library("central", "Central Library", loan_limit=2, command_id="open-central")
        for book_id, title in [("dune", "Dune"), ("emma", "Emma"), ("ulysses", "Ulysses")]:
            await app.add_book("central", book_id, title, command_id=f"add-{book_id}")
        await app.lend("central", "dune", "ann", command_id="lend-dune")
        await app.lend("central", "emma", "ann", command_id="lend-emma")
        try:
            await app.lend("central", "ulysses", "ann", command_id="lend-ulysses")
        except DomainError as refused:
            print(f"refused: {refused}")
        central = await app.state("central")
        for book_id, title in central.titles.items():
            print(f"{title}: {central.lent_to.get(book_id, 'on the shelves')}")


if __name__ == "__main__":
    asyncio.run(main())

"""The library's commands, served over NATS: ``jetsourcing serve library.service:commands``."""

from typing import Any

from pydantic import BaseModel

from aggregates import CommandService
from eventstore import EventStore
from library.app import LibraryApp
from library.domain import Library

# A command is a pydantic model; it travels as JSON on the subject cmd.Library.<its class name>.


class OpenLibrary(BaseModel):
    name: str
    loan_limit: int


class AddBook(BaseModel):
    book_id: str
    title: str


class LendBook(BaseModel):
    book_id: str
    member: str


class ReturnBook(BaseModel):
    book_id: str


def commands(store: EventStore, **options: Any) -> CommandService:
    """The command service `jetsourcing serve` runs: each command's handler, on the library it is sent to."""
    app = LibraryApp(store)
    service = app.command_service(**options)  # options: the prefix, queue group, ... `jetsourcing serve` was given
    libraries = app.repository(Library)
    service.add(libraries, OpenLibrary, lambda lib, c: lib.open(c.name, c.loan_limit), create=True)
    service.add(libraries, AddBook, lambda lib, c: lib.add_book(c.book_id, c.title))
    service.add(libraries, LendBook, lambda lib, c: lib.lend(c.book_id, c.member))
    service.add(libraries, ReturnBook, lambda lib, c: lib.take_back(c.book_id))
    return service

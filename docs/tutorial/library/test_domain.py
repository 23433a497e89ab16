"""The library's rules, tested given/when/then: a history, one command, and what it recorded (or the refusal).

They run in memory, with no server: ``python -m pytest library/test_domain.py``.
"""

from aggregates import Scenario, scenario
from eventstore import InMemoryEventStore
from library.domain import (
    BookAdded,
    BookLent,
    BookNotAvailable,
    BookReturned,
    Library,
    LibraryOpened,
    LoanLimitReached,
)

OPENED = LibraryOpened(name="Central Library", loan_limit=2)
DUNE = BookAdded(book_id="dune", title="Dune")
EMMA = BookAdded(book_id="emma", title="Emma")
ULYSSES = BookAdded(book_id="ulysses", title="Ulysses")


def library() -> Scenario[Library]:
    """A scenario on a new library, in an event store held in memory."""
    return scenario(InMemoryEventStore(), Library)


async def test_opening_a_library_records_its_loan_limit() -> None:
    await library().when(lambda lib: lib.open("Central Library", 2)).then(OPENED)


async def test_a_book_on_the_shelves_is_lent() -> None:
    await library().given(OPENED, DUNE).when(lambda lib: lib.lend("dune", "ann")).then(
        BookLent(book_id="dune", member="ann")
    )


async def test_a_lent_book_cannot_be_lent_again() -> None:
    await library().given(OPENED, DUNE, BookLent(book_id="dune", member="ann")).when(
        lambda lib: lib.lend("dune", "bob")
    ).then(BookNotAvailable)


async def test_a_member_holds_at_most_the_loan_limit() -> None:
    await library().given(
        OPENED, DUNE, EMMA, ULYSSES, BookLent(book_id="dune", member="ann"), BookLent(book_id="emma", member="ann")
    ).when(lambda lib: lib.lend("ulysses", "ann")).then(LoanLimitReached)


async def test_a_returned_book_can_be_lent_again() -> None:
    await library().given(
        OPENED, DUNE, BookLent(book_id="dune", member="ann"), BookReturned(book_id="dune")
    ).when(lambda lib: lib.lend("dune", "bob")).then(BookLent(book_id="dune", member="bob"))

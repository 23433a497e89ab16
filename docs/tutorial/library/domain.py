"""The lending library's domain: what can happen (events) and the rules (the ``Library`` aggregate)."""

from pydantic import BaseModel

from aggregates import Aggregate, DomainError, DomainEvent, applies

# -- events: facts, named in the past tense, never changed once stored ---------------------------


class LibraryOpened(DomainEvent):
    """A library opened; a member may hold at most ``loan_limit`` of its books at once."""

    name: str
    loan_limit: int


class BookAdded(DomainEvent):
    """A book joined the library's shelves."""

    book_id: str
    title: str


class BookLent(DomainEvent):
    """A book was lent to a member."""

    book_id: str
    member: str


class BookReturned(DomainEvent):
    """A lent book came back."""

    book_id: str


# -- refusals: a command that breaks a rule raises one, and nothing is recorded -------------------


class LibraryError(DomainError):
    """A library command was refused."""


class BookNotAvailable(LibraryError):
    """The book is lent to someone already."""


class LoanLimitReached(LibraryError):
    """The member holds as many books as the library allows."""


# -- the aggregate ------------------------------------------------------------------------------


class LibraryState(BaseModel):
    """What a library knows, rebuilt from its events."""

    name: str = ""
    loan_limit: int = 0
    titles: dict[str, str] = {}  # book id -> title
    lent_to: dict[str, str] = {}  # book id -> member, for the books that are out


class Library(Aggregate[LibraryState]):
    """One library: its books and who holds them. Its events are stored as ``Library/<id>``."""

    # Commands check the rules against the state, then record what happened.

    def open(self, name: str, loan_limit: int) -> None:
        if loan_limit < 1:
            raise LibraryError(f"A member must be allowed at least one book, not {loan_limit}.")
        self.record(LibraryOpened(name=name, loan_limit=loan_limit))

    def add_book(self, book_id: str, title: str) -> None:
        if book_id in self.state.titles:
            raise LibraryError(f"There is a book {book_id!r} already.")
        self.record(BookAdded(book_id=book_id, title=title))

    def lend(self, book_id: str, member: str) -> None:
        title = self._title(book_id)
        holder = self.state.lent_to.get(book_id)
        if holder is not None:
            raise BookNotAvailable(f"{title} is lent to {holder}.")
        held = list(self.state.lent_to.values()).count(member)
        if held >= self.state.loan_limit:
            raise LoanLimitReached(f"{member} holds {held} books: the most this library lends to one member.")
        self.record(BookLent(book_id=book_id, member=member))

    def take_back(self, book_id: str) -> None:
        title = self._title(book_id)
        if book_id not in self.state.lent_to:
            raise LibraryError(f"{title} is not lent.")
        self.record(BookReturned(book_id=book_id))

    def _title(self, book_id: str) -> str:
        if book_id not in self.state.titles:
            raise LibraryError(f"There is no book {book_id!r}.")
        return self.state.titles[book_id]

    # Handlers only move the state: they run again each time the library is loaded from its events.

    @applies(LibraryOpened)
    def _opened(self, event: LibraryOpened) -> None:
        self.state.name = event.name
        self.state.loan_limit = event.loan_limit

    @applies(BookAdded)
    def _added(self, event: BookAdded) -> None:
        self.state.titles[event.book_id] = event.title

    @applies(BookLent)
    def _lent(self, event: BookLent) -> None:
        self.state.lent_to[event.book_id] = event.member

    @applies(BookReturned)
    def _returned(self, event: BookReturned) -> None:
        del self.state.lent_to[event.book_id]

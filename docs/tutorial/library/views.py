"""The library's read model: a catalogue of every book, kept up to date from the events.

``jetsourcing run library.views:Catalogue`` keeps it in SQLite;
``jetsourcing spark rebuild library.views:Catalogue --root lake`` builds it in Delta tables.
"""

from eventstore import RecordedEvent
from projections import Projection, Table, Transaction, handles

from library.domain import BookAdded, BookLent, BookReturned


class Catalogue(Projection):
    """One row per book: its library, its title, who holds it, and how often it was lent."""

    name = "catalogue"  # the read model's name: never change it
    version = 1  # raise it when the tables or handlers change: the read model is rebuilt
    categories = ("Library",)  # the events it reads: those of the Library aggregates
    tables = (
        Table(
            "books",
            key=("library_id", "book_id"),
            columns={"library_id": str, "book_id": str, "title": str, "lent_to": str | None, "times_lent": int},
        ),
    )

    @handles(BookAdded)
    def added(self, event: RecordedEvent, tx: Transaction) -> None:
        book = event.data
        assert isinstance(book, BookAdded)
        library_id = event.stream_id.entity_id  # the library the event belongs to
        tx.upsert("books", (library_id, book.book_id), {"title": book.title, "lent_to": None, "times_lent": 0})

    @handles(BookLent)
    def lent(self, event: RecordedEvent, tx: Transaction) -> None:
        loan = event.data
        assert isinstance(loan, BookLent)
        key = (event.stream_id.entity_id, loan.book_id)
        row = tx.get("books", key)
        assert row is not None  # a library lends only books it added
        tx.upsert("books", key, {**row, "lent_to": loan.member, "times_lent": row["times_lent"] + 1})

    @handles(BookReturned)
    def returned(self, event: RecordedEvent, tx: Transaction) -> None:
        back = event.data
        assert isinstance(back, BookReturned)
        key = (event.stream_id.entity_id, back.book_id)
        row = tx.get("books", key)
        assert row is not None
        tx.upsert("books", key, {**row, "lent_to": None})

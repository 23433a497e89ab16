"""Print the catalogue from the read model that `jetsourcing run` keeps: ``python -m library.report``."""

import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any

QUERY = "SELECT library_id, title, lent_to, times_lent FROM books ORDER BY library_id, title"


def show(books: Iterable[Mapping[str, Any]]) -> None:
    for book in books:
        print(f"{book['library_id']:<10} {book['title']:<12} {book['lent_to'] or '-':<4} lent {book['times_lent']}x")


if __name__ == "__main__":
    # The daemon keeps its read models in jetsourcing.sqlite3 (--db or JETSOURCING_DATABASE choose another).
    db = sqlite3.connect("jetsourcing.sqlite3")
    db.row_factory = sqlite3.Row  # rows by column name
    show(db.execute(QUERY))

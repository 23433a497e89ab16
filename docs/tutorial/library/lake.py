"""Print the catalogue from the Delta table Spark wrote to lake/books: ``python -m library.lake``."""

import pyarrow
from deltalake import DeltaTable, QueryBuilder

from library.report import QUERY, show

# The same query as on SQLite, run by the deltalake package: reading a Delta table needs no Spark.
books = QueryBuilder().register("books", DeltaTable("lake/books")).execute(QUERY).read_all()
show(pyarrow.table(books).to_pylist())

"""Spark batch projections of jetsourcing event streams into Delta Lake.

Modules, one job each:

* :mod:`spark_projections.session` - ``spark_session(settings)``: a Spark session with
  Delta Lake guaranteed usable (settings in :mod:`spark_projections.settings`);
* :mod:`spark_projections.delta` - ``full_rebuild`` / ``incremental_merge`` into Delta,
  exactly once per stream position, and ``recorded_position`` / ``table_history``;
* :mod:`spark_projections.jars` - where the Delta jars come from (Maven or offline folder);
* :mod:`spark_projections.java` - the Java 17+ check done before a JVM starts;
* :mod:`spark_projections.errors` - the typed errors, each with a user-facing remedy;
* :mod:`spark_projections.cli` - ``jetsourcing-spark check`` / ``fetch-delta-jars``.
"""

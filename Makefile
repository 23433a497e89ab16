# Two commands for a newcomer: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install docs bench lint clean

# The native framing of bulk reads is compiled by the install: rebuild when its C source changes.
$(STAMP): pyproject.toml eventstore/_native.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,spark,postgres,docs]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m samples.demo

test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest

# The site lands in build/site (open build/site/index.html); strict: a broken link or reference fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

lint: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) benchmarks/bench_eventstore.py
	$(PY) benchmarks/bench_aggregates.py
	$(PY) benchmarks/bench_commands.py
	$(PY) benchmarks/bench_projections.py
	$(PY) benchmarks/bench_postgres.py
	$(PY) benchmarks/bench_spark.py

clean:
	rm -rf $(VENV) .pytest_cache spark-warehouse build eventstore/*.so

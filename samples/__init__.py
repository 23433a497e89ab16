"""Samples written against jetsourcing's public API only: a bank (``samples.bank``) and its demo (``samples.demo``).

Run the demo with ``make demo`` or ``python -m samples.demo --help``.
"""

"""A small lending library on jetsourcing: the code of the documentation's tutorial."""

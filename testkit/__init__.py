"""Helpers that tests and benches share and the product does not ship: generated models, an in-process chain."""

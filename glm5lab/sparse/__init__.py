"""Sparse MLA as vLLM hands it to a backend: top-k indices -> global KV slots -> virtual block table,
and the torch references every kernel is checked against (notebook 04)."""

"""Benchmarks and accuracy: long-format CSV rows with provenance, plots drawn from the CSV."""

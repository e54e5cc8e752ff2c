"""Triton kernels, each beside its torch reference and its tests: paged MLA decode, fused sparse MLA,
the DSA indexer. They need torch and triton only, so any engine can call them."""

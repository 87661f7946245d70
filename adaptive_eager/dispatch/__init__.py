"""Interception: the dispatch and function modes, lazy tensors, and per-op policy."""

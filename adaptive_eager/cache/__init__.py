"""Trace caches: in memory (trie of traces, op metadata)."""

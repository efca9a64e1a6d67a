"""Paged KV: the block pool (pure-Python accounting) and the paged_attention op."""
from kiln.plugins.paged_kv import ops  # noqa: F401  (registers kiln::paged_attention)

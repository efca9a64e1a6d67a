"""Mixture of experts: routing and the kiln::moe_experts op (grouped expert SwiGLU MLPs)."""
from kiln.plugins.moe import ops  # noqa: F401  (registers kiln::moe_experts)

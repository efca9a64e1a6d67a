"""Quantized linear ops (int8 per channel, int4 group-wise, fp8 E4M3) and their formats.

Importing registers the kiln::linear_{int8,int4,fp8} schemas and reference kernels;
`plugins.quant.kernels.load()` adds the compiled CPU kernels.
"""
from kiln.plugins.quant import ops  # noqa: F401  (registers the kiln::linear_* ops)

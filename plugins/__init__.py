"""What is compiled into or runs beside a plan's graph: paged KV, in-flight batching, quant.

Imports neither `builder` nor `runtime`.
"""

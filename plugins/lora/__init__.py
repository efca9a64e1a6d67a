"""Multi-LoRA: the kiln::lora_apply op (batched low-rank adapter deltas, grouped by adapter)."""
from kiln.plugins.lora import ops  # noqa: F401  (registers kiln::lora_apply)

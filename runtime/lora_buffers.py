"""The adapter inputs of a plan built with `lora`: S slots of stacked A/B weights and scales
that the step reads (builder/arch/lora.py), and the per-token slot of each step.

    scales [S] float32;  per target module: a [L, S, R, in], b [L, S, out, R] (the section's
    dtype: an adapter's float32 weights are rounded to bfloat16 when written into a slot)

An adapter is written into a slot (its rank zero-padded to R, modules it does not change
left zero) and stays there until the slot is given to another; a step only passes each
token's slot (-1: the base model). The buffers are allocated once and written in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.contracts.manifest import LoraSection

STEP_INPUT_NAMES = ("lora_slots", "lora_scales", "lora_a", "lora_b")


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's weights on the host, already in the plan's layout (float32)."""
    name: str
    rank: int
    scale: float
    a: dict[str, torch.Tensor]    # module -> [L, rank, in]
    b: dict[str, torch.Tensor]    # module -> [L, out, rank]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


class LoraBuffers:
    """The stacked slots a LoRA plan's step reads."""

    def __init__(self, section: LoraSection, num_layers: int, device="cpu"):
        self.section = section
        S, R = section.max_adapters_per_batch, section.max_rank
        dtype = getattr(torch, section.dtype)
        self.scales = torch.zeros(S, dtype=torch.float32, device=device)
        self.a = [torch.zeros(num_layers, S, R, section.in_features[m], dtype=dtype,
                              device=device) for m in section.target_modules]
        self.b = [torch.zeros(num_layers, S, section.out_features[m], R, dtype=dtype,
                              device=device) for m in section.target_modules]

    @property
    def num_slots(self) -> int:
        return self.section.max_adapters_per_batch

    @torch.no_grad()
    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Put `adapter` into `slot` (replacing whatever was there)."""
        r = adapter.rank
        self.scales[slot] = adapter.scale
        for m, a, b in zip(self.section.target_modules, self.a, self.b):
            a[:, slot].zero_()
            b[:, slot].zero_()
            if m in adapter.a:
                a[:, slot, :r].copy_(adapter.a[m])
                b[:, slot, :, :r].copy_(adapter.b[m])

    def args(self, slots: torch.Tensor) -> tuple:
        """The step's trailing inputs for per-token `slots` [T] int64."""
        return (slots, self.scales, self.a, self.b)

    @torch.no_grad()
    def fill_random(self, generator: torch.Generator, b_std: float = 0.05) -> None:
        """Every slot a random full-rank adapter of scale 1 (the build's compiled-vs-eager
        check: the adapter terms must move the logits for the check to see them)."""
        self.scales.fill_(1.0)
        for a, b in zip(self.a, self.b):
            a.copy_(torch.randn(a.shape, generator=generator) / a.shape[-1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=generator) * b_std)

    def token_slots(self, seq_slots, counts) -> torch.Tensor:
        """[T] int64: each sequence's slot repeated over its tokens this step."""
        return torch.repeat_interleave(torch.as_tensor(seq_slots, dtype=torch.int64),
                                       torch.as_tensor(counts, dtype=torch.int64))


def base_only(step_fn, section: LoraSection, num_layers: int):
    """A LoRA plan's step as a plan without lora is called: every token on the base model
    (the accuracy gate scores the base model)."""
    empty = LoraBuffers(section, num_layers)

    def step(*args):
        slots = torch.full(args[0].shape, -1, dtype=torch.int64)
        return step_fn(*args, *empty.args(slots))
    return step

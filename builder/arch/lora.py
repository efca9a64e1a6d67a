"""LoRA terms in the decoder step: the stacked adapters of one step, per layer, and the
linears they add to (the kiln::lora_apply op, plugins/lora; on CUDA kiln::lora_apply_triton).
DecoderModel.enable_lora makes a model's step take them.

The step's extra inputs (runtime/lora.py fills them):

    lora_slots  [T] int64             each token's adapter slot (-1: the base model)
    lora_scales [S] float32           each slot's scale (lora_alpha / r, or / sqrt(r): rsLoRA)
    lora_a      per target module     [L, S, R, in]  (ranks below R zero-padded)
    lora_b      per target module     [L, S, out, R]  (A and B: float32 or bfloat16, lora.dtype)

Target modules by PEFT's names; kiln's fused linears take them on their parts:

    wqkv = q_proj | k_proj | v_proj     w13 = gate_proj | up_proj
    wo   = o_proj                       w2  = down_proj
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.builder.arch.config import DecoderConfig
from kiln.plugins.lora import ops as lora_ops  # noqa: F401  (registers kiln::lora_apply)

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_dims(cfg: DecoderConfig) -> dict[str, tuple[int, int]]:
    """Each LoRA target's (in, out) widths for a config."""
    h, q, kv, i = (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                   cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoraLayer:
    """One layer's view of the step's adapters."""
    slots: torch.Tensor                   # [T]
    scales: torch.Tensor                  # [S]
    a: dict[str, torch.Tensor]            # module -> [S, R, in]
    b: dict[str, torch.Tensor]            # module -> [S, out, R]

    def apply(self, module: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the base linear's output for input x) plus the module's LoRA term, if the plan
        targets it."""
        if module not in self.a:
            return y
        op = torch.ops.kiln.lora_apply
        if y.device.type == "cuda":                # chosen when traced: devices are static
            from kiln.plugins.lora import triton_lora  # noqa: F401  (imports triton)

            op = torch.ops.kiln.lora_apply_triton
        return op(y, x, self.slots, self.a[module], self.b[module], self.scales)


@dataclass
class LoraStep:
    """The step's adapter inputs, by target module."""
    slots: torch.Tensor
    scales: torch.Tensor
    a: dict[str, torch.Tensor]            # module -> [L, S, R, in]
    b: dict[str, torch.Tensor]            # module -> [L, S, out, R]

    @classmethod
    def of(cls, targets: tuple[str, ...], slots, scales, lora_a, lora_b) -> "LoraStep":
        if len(lora_a) != len(targets) or len(lora_b) != len(targets):
            raise ValueError(f"the step takes A and B stacks for {list(targets)}; got "
                             f"{len(lora_a)} and {len(lora_b)}")
        return cls(slots, scales, dict(zip(targets, lora_a)), dict(zip(targets, lora_b)))

    def layer(self, i: int) -> LoraLayer:
        return LoraLayer(self.slots, self.scales, {m: t[i] for m, t in self.a.items()},
                         {m: t[i] for m, t in self.b.items()})

"""LoRA adapters for tests: PEFT-format directories written from tensors (the layout PEFT's
save_pretrained writes), and a small LoraSection."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.contracts.manifest import LoraSection

PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def section(max_rank=8, targets=("q_proj", "v_proj", "down_proj"), slots=2, cpu=3,
            hidden=16, inter=24, kv=8) -> LoraSection:
    ins = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": hidden,
           "gate_proj": hidden, "up_proj": hidden, "down_proj": inter}
    outs = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden,
            "gate_proj": inter, "up_proj": inter, "down_proj": hidden}
    return LoraSection(max_rank=max_rank, target_modules=tuple(targets),
                       max_adapters_per_batch=slots, max_cpu_adapters=cpu,
                       in_features={m: ins[m] for m in targets},
                       out_features={m: outs[m] for m in targets})


def write_peft(path: Path, sec: LoraSection, num_layers: int, r: int, modules, seed: int = 0,
               alpha: float = 16.0, **config) -> dict[str, torch.Tensor]:
    """A PEFT LoRA directory with random A and B of rank r on `modules`; -> its tensors."""
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers):
        for m in modules:
            key = f"base_model.model.model.layers.{i}.{PREFIX[m]}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, sec.in_features[m], generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(sec.out_features[m], r, generator=g)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules),
           "bias": "none", "use_rslora": False, "base_model_name_or_path": None, **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return tensors


def randomize_peft(model, seed: int, b_scale: float):
    """A peft model's LoRA weights drawn from `seed`: A ~ N(0, 1/in), B ~ N(0, b_scale^2)
    (non-zero B, so the adapter changes the output); returns the model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * b_scale)
    return model.eval()

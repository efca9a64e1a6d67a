"""Read a LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`)
into the plan's layout (runtime/lora_buffers.AdapterWeights), refusing what the plan cannot
serve with what is wrong.

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_B.weight    [out, r]

A checkpoint that fuses linears (Phi-3) has adapters on the fused ones; each maps onto the
plan's modules it stacks (FUSED), which is exactly the same term: the one A for every part,
B split by rows in the order the parts stack (q|k|v, gate|up).

    self_attn.qkv_proj  A [r, hidden]  B [q + 2*kv, r]  ->  q_proj, k_proj, v_proj
    mlp.gate_up_proj    A [r, hidden]  B [2*inter, r]   ->  gate_proj, up_proj

scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

import torch

from kiln.contracts.manifest import LoraSection
from kiln.runtime.lora_buffers import AdapterWeights

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_GGUF_QUANT = re.compile(r"[.-](?:i?q\d\w*|bf16|f16|f32)$")     # .Q4_1, -q4_k_m, -f16
# a fused PEFT module -> the plan's modules it stacks along its output rows, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AdapterError(ValueError):
    """An adapter the plan cannot serve; the message says what is wrong."""


def read_config(path: Path) -> dict:
    f = path / CONFIG_FILE
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: no {CONFIG_FILE} (a PEFT LoRA adapter directory has "
                           f"{CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{f}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{f}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{f}: peft_type {cfg.get('peft_type')!r}; only LORA adapters")
    unsupported = [(k, cfg.get(k)) for k in ("use_dora", "fan_in_fan_out", "lora_bias")
                   if cfg.get(k)]
    unsupported += [(k, cfg[k]) for k in ("rank_pattern", "alpha_pattern", "modules_to_save")
                    if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(("bias", cfg["bias"]))
    if unsupported:
        k, v = unsupported[0]
        raise AdapterError(f"{f}: {k} = {v!r} is not supported (plain LoRA on the layers' "
                           "linears only)")
    for k in ("r", "lora_alpha"):
        if not isinstance(cfg.get(k), (int, float)) or isinstance(cfg.get(k), bool) \
                or cfg[k] <= 0:
            raise AdapterError(f"{f}: {k} = {cfg.get(k)!r}; a positive number is needed")
    return cfg


def base_names(base_model: str) -> set[str]:
    """The names the plan's checkpoint goes by, lowercased: its path's last component; for a
    GGUF file also the model's name (the file's without `.gguf` and its quantization tag:
    `SmolLM2-135M-Instruct.Q4_1.gguf` is `smollm2-135m-instruct`) and its directory's (what
    transformers records for a model loaded with from_pretrained(dir, gguf_file=...))."""
    parts = str(base_model).rstrip("/").lower().split("/")
    names = {parts[-1]}
    if parts[-1].endswith(".gguf"):
        names.add(_GGUF_QUANT.sub("", parts[-1][:-len(".gguf")]))
        if len(parts) > 1 and parts[-2]:
            names.add(parts[-2])
    return names


def check_base(cfg: dict, base_model: Optional[str], path: Path) -> None:
    """AdapterError when the adapter records another base model than the plan's (the last
    component of the recorded name or path against base_names; nothing to compare when either
    is unknown)."""
    recorded = cfg.get("base_model_name_or_path")
    if not recorded or not base_model:
        return
    if str(recorded).rstrip("/").split("/")[-1].lower() not in base_names(base_model):
        raise AdapterError(f"{path}: the adapter was trained on {recorded!r}; this plan's base "
                           f"model is {base_model!r}")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = path / WEIGHTS_FILE
    if not f.is_file():
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterError(f"{f}: not a readable safetensors file (corrupt or truncated?): "
                           f"{e}") from None


def _parts(path: Path, key: str, module: str, which: str, t: torch.Tensor, r: int,
           section: LoraSection) -> list[tuple[str, torch.Tensor]]:
    """[(plan module, its A or B)] of one adapter tensor: itself, or a fused module's parts
    (A shared, B split by rows); AdapterError for a module or shape the plan cannot take."""
    parts = FUSED.get(module, (module,))
    missing = [p for p in parts if p not in section.target_modules]
    if missing:
        fused = f" (fused: {', '.join(parts)})" if module in FUSED else ""
        raise AdapterError(f"{path}: the adapter changes {module}{fused}; this plan was built "
                           f"for {', '.join(section.target_modules)} (lora.target_modules)")
    outs = [section.out_features[p] for p in parts]
    want = (r, section.in_features[parts[0]]) if which == "A" else (sum(outs), r)
    if tuple(t.shape) != want:
        raise AdapterError(f"{path}: {key} has shape {list(t.shape)}; the base model's "
                           f"{module} with rank {r} needs {list(want)}")
    if which == "A":
        return [(p, t) for p in parts]
    return list(zip(parts, t.split(outs, dim=0)))


def load_peft(path, name: str, section: LoraSection, num_layers: int,
              base_model: Optional[str] = None) -> AdapterWeights:
    """The adapter at `path` in the plan's layout; AdapterError naming what does not fit."""
    path = Path(path)
    cfg = read_config(path)
    check_base(cfg, base_model, path)
    r = int(cfg["r"])
    if r > section.max_rank:
        raise AdapterError(f"{path}: rank {r} exceeds the plan's lora.max_rank "
                           f"({section.max_rank})")
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    a, b = {}, {}
    for key, t in _read_tensors(path).items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                               "layer's linear")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= num_layers:
            raise AdapterError(f"{path}: {key} is for layer {layer}; the model has "
                               f"{num_layers} layers")
        dst = a if which == "A" else b
        for part, w in _parts(path, key, module, which, t, r, section):
            if part not in dst:
                dst[part] = torch.zeros(num_layers, *w.shape)
            dst[part][layer] = w.float()
    if set(a) != set(b) or not a:
        raise AdapterError(f"{path}: every module needs both lora_A and lora_B "
                           f"(A: {sorted(a)}, B: {sorted(b)})")
    return AdapterWeights(name, r, float(scale), a, b)

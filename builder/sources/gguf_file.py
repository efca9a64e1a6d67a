"""A GGUF file (llama.cpp): config and tokenizer from metadata, tensors dequantized to float.

Supported architectures: those of builder/arch/families.py (llama incl. SmolLM and
Mistral-as-llama, mistral, qwen2, qwen3). Every
quantization `gguf.quants.dequantize` knows (Q4_0/1, Q5_x, Q8_0, K-quants, F16, BF16, F32).
weights_digest is the sha256 of the file (what `sha256sum` prints).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from kiln.builder.arch.config import DecoderConfig
from kiln.builder.arch.families import family_for_gguf, plan_mapping
from kiln.builder.arch.weights import MappingError
from kiln.builder.sources.base import Checkpoint, CheckpointError, build_mapped
from kiln.builder.sources.digest import file_sha256
from kiln.builder.sources.tokenizer_build import from_gguf_vocab

MAGIC = b"GGUF"


def _reader(path: Path):
    import gguf
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (magic {head!r}, expected {MAGIC!r})")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError, IndexError, ... on damaged files
        raise CheckpointError(f"{path}: corrupt or truncated GGUF: {type(e).__name__}: "
                              f"{e}") from None


def _metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an exotic value type; not one we read
            continue
    return meta


def _config(meta: dict, names: set[str], path: Path,
            read: Callable[[str], torch.Tensor]) -> DecoderConfig:
    arch = meta.get("general.architecture")
    try:
        family = family_for_gguf(arch)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None

    def get(key, default=None, required=True):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise CheckpointError(f"{path}: metadata key {full} is missing")
        return default

    scaling = get("rope.scaling.type", "none", required=False)
    if scaling not in ("none", None, *family.gguf_rope_scaling) or "rope_freqs.weight" in names:
        raise CheckpointError(f"{path}: rope scaling ({scaling!r}"
                              f"{', rope_freqs.weight' if 'rope_freqs.weight' in names else ''})"
                              " in a GGUF is not supported; use the HF checkpoint")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    head_dim = get("attention.key_length", None, required=False) or (
        get("rope.dimension_count", None, required=False) if arch != "qwen2" else None)
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta]
    try:
        fields = dict(
            vocab_size=int(get("vocab_size", len(tokens) or None)),
            hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")), num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(head_dim or hidden // heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)), family=arch,
            **_experts(get, names), **family.gguf_options(arch, names))
        if family.gguf_config is not None:   # fields the family reads itself (may override)
            fields.update(family.gguf_config(meta, read))
        return DecoderConfig(**fields)
    except KeyError as e:
        raise CheckpointError(f"{path}: metadata key {e.args[0]} is missing") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: inconsistent metadata: {e}") from None


def _experts(get, names: set[str]) -> dict:
    """The mixture-of-experts fields, from llama.cpp's keys of any architecture
    ({arch}.expert_count, expert_used_count, expert_feed_forward_length, expert_weights_norm);
    the sparse layers are those with a router (blk.N.ffn_gate_inp.weight)."""
    count = int(get("expert_count", 0, required=False) or 0)
    sparse = tuple(sorted(int(n.split(".")[1]) for n in names
                          if n.startswith("blk.") and n.endswith(".ffn_gate_inp.weight")))
    if not count and not sparse:
        return {}
    if not count or not sparse:
        raise ValueError(f"expert_count is {count} and {len(sparse)} layers have a router "
                         "(ffn_gate_inp): both or neither")
    return dict(num_experts=count, experts_per_token=int(get("expert_used_count")),
                moe_intermediate_size=int(get("expert_feed_forward_length", None, False)
                                          or get("feed_forward_length")),
                normalize_topk=bool(get("expert_weights_norm", True, False)),
                sparse_layers=sparse)


def _dequantize(t, path: Path) -> torch.Tensor:
    from gguf.quants import dequantize
    try:
        arr = dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot dequantize tensor {t.name} "
                              f"({t.tensor_type.name}): {e}") from None
    shape = tuple(int(d) for d in reversed(t.shape))   # GGUF dims are innermost-first
    if arr.size != int(np.prod(shape)):
        raise CheckpointError(f"{path}: tensor {t.name} has {arr.size} values, its shape "
                              f"{list(shape)} needs {int(np.prod(shape))} (truncated file?)")
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable:          # F32/F16 views of the memory-mapped file
        arr = arr.copy()
    return torch.from_numpy(arr)


def _quant_name(meta: dict, tensors) -> str:
    """Q4_1, Q8_0, F16 ...: the file type, else the commonest type of the 2-D tensors."""
    import gguf
    try:
        name = gguf.LlamaFileType(meta["general.file_type"]).name
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (KeyError, ValueError):
        kinds = Counter(t.tensor_type.name for t in tensors if len(t.shape) >= 2)
        return kinds.most_common(1)[0][0] if kinds else "no tensors"


def open_gguf(path: Path) -> Checkpoint:
    reader = _reader(path)
    meta = _metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, set(tensors), path, lambda n: _dequantize(tensors[n], path))
    try:
        plan = plan_mapping(config, "gguf", tensors)
    except MappingError as e:
        raise CheckpointError(f"{path}: {e}") from None
    try:
        tokenizer_json = from_gguf_vocab(meta, str(path))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    toks = meta.get("tokenizer.ggml.tokens") or []
    bos = meta.get("tokenizer.ggml.bos_token_id")
    generation = {
        "bos_token_id": bos,
        "eos_token_ids": list(config.eos_token_ids),
        "chat_template": meta.get("tokenizer.chat_template"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token",
                                       meta.get("tokenizer.ggml.model") == "llama"))
        and bos is not None and bos < len(toks),
    }
    qname = _quant_name(meta, reader.tensors)

    def stream(dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        yield from build_mapped(plan, lambda n: _dequantize(tensors[n], path), config, path,
                                dtype)

    def select(dtype: torch.dtype, names: set) -> Iterator[tuple[str, torch.Tensor]]:
        yield from build_mapped([m for m in plan if m.target in names],
                                lambda n: _dequantize(tensors[n], path), config, path, dtype)

    return Checkpoint(config=config, tokenizer_json=tokenizer_json, generation=generation,
                      _weights_digest=lambda: file_sha256(path),
                      source_desc=f"gguf {path} ({qname})", _stream=stream, _select=select)

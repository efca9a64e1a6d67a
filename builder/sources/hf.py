"""A Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer files.

Shards are validated with safetensors' `safe_open`; tensors are then read one at a time with
plain file reads (no mapping held: see _read_tensor).
weights_digest covers every file read (config, generation config, tokenizer files and
weight shards): sha256 of their `sha256sum` lines, sorted by name.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from kiln.builder.arch.config import UnsupportedConfig
from kiln.builder.arch.families import config_from_hf, plan_mapping
from kiln.builder.arch.weights import MappingError
from kiln.builder.sources.base import Checkpoint, CheckpointError, build_mapped
from kiln.builder.sources.digest import files_sha256

INDEX = "model.safetensors.index.json"


def _read_json(path: Path, required: bool = True) -> Optional[dict]:
    if not path.exists():
        if required:
            raise CheckpointError(f"{path}: missing (a HF checkpoint directory needs it)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _shards(root: Path) -> list[str]:
    """Weight files, in a stable order: from the index if there is one, else *.safetensors."""
    index = _read_json(root / INDEX, required=False)
    if index is not None:
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{root / INDEX}: no weight_map")
        names = sorted(set(wm.values()))
        for n in names:
            if not (root / n).is_file():
                raise CheckpointError(f"{root / n}: missing (listed in {INDEX})")
        return names
    names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"{root}: no *.safetensors weight files")
    return names


def _tensor_files(root: Path, shards: list[str]) -> dict[str, str]:
    """Tensor name -> shard file, reading each shard's header (cheap) to validate it."""
    where: dict[str, str] = {}
    for shard in shards:
        path = root / shard
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
        except Exception as e:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{path}: not a readable safetensors file (truncated or "
                                  f"corrupt?): {e}") from None
        for k in keys:
            if k in where:
                raise CheckpointError(f"{path}: tensor {k} also in {root / where[k]}")
            where[k] = shard
    return where


# safetensors dtype names -> torch dtypes (the format's spec: huggingface/safetensors README)
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _header(path: Path) -> tuple[int, dict]:
    """(offset of the data, the header's tensor entries) of a safetensors file (already
    validated by safe_open when the checkpoint was opened)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def _read_tensor(path: Path, data_start: int, header: dict, name: str) -> torch.Tensor:
    """One tensor read with a plain file read into its own buffer: no mapping of the shard
    stays in this process (a mapped shard keeps every page read resident: 1B bf16 = 2 GB of
    RSS by the end of a load), and no second copy is made (safe_open's get_tensor made one)."""
    entry = header[name]
    begin, end = entry["data_offsets"]
    dtype = _DTYPES[entry["dtype"]]
    buf = torch.empty(end - begin, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        f.seek(data_start + begin)
        got = f.readinto(memoryview(buf.numpy()))
    if got != end - begin:
        raise ValueError(f"{got} of {end - begin} bytes (truncated file?)")
    return buf.view(dtype).reshape(entry["shape"])


def _chat_template(root: Path, tok_cfg: dict) -> Optional[str]:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    ct = tok_cfg.get("chat_template")
    if isinstance(ct, list):  # [{"name": "default", "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in ct if isinstance(d, dict)}
        ct = named.get("default")
    return ct if isinstance(ct, str) else None


def _token_id(tok: Tokenizer, value) -> Optional[int]:
    if isinstance(value, dict):          # serialized AddedToken
        value = value.get("content")
    return tok.token_to_id(value) if isinstance(value, str) else None


def open_hf_dir(root: Path) -> Checkpoint:
    cfg_json = _read_json(root / "config.json")
    try:
        config = config_from_hf(cfg_json)
    except UnsupportedConfig as e:   # names the key, its value and what is supported
        raise CheckpointError(f"{root / 'config.json'}: {e}") from None
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{root / 'config.json'}: cannot make a model config: "
                              f"{e!r}") from None
    shards = _shards(root)
    where = _tensor_files(root, shards)
    try:
        plan = plan_mapping(config, "hf", where)
    except MappingError as e:
        raise CheckpointError(f"{root}: {e}") from None

    tok_path = root / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"{tok_path}: missing (a HF checkpoint directory needs it)")
    tokenizer_json = tok_path.read_text(encoding="utf-8")
    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as e:
        raise CheckpointError(f"{tok_path}: not a tokenizers JSON: {e}") from None
    tok_cfg = _read_json(root / "tokenizer_config.json", required=False) or {}
    gen_cfg = _read_json(root / "generation_config.json", required=False) or {}

    eos = gen_cfg.get("eos_token_id", cfg_json.get("eos_token_id"))
    eos_ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
    if not eos_ids and _token_id(tok, tok_cfg.get("eos_token")) is not None:
        eos_ids = [_token_id(tok, tok_cfg.get("eos_token"))]
    bos = gen_cfg.get("bos_token_id", cfg_json.get("bos_token_id"))
    pad = gen_cfg.get("pad_token_id", cfg_json.get("pad_token_id"))
    if pad is None:
        pad = _token_id(tok, tok_cfg.get("pad_token"))
    probe = tok.encode("a").ids
    generation = {
        "bos_token_id": bos,
        "eos_token_ids": [int(i) for i in eos_ids],
        "chat_template": _chat_template(root, tok_cfg),
        "pad_token_id": pad,
        "add_bos_token": bool(probe) and bos is not None and probe[0] == bos,
    }
    read_files = [n for n in ("config.json", "generation_config.json", "tokenizer.json",
                              "tokenizer_config.json", "chat_template.jinja", INDEX)
                  if (root / n).is_file()] + shards

    headers: dict[str, tuple[int, dict]] = {}

    def read(name: str) -> torch.Tensor:
        shard = where[name]
        if shard not in headers:
            headers[shard] = _header(root / shard)
        try:
            return _read_tensor(root / shard, *headers[shard], name)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{root / shard}: cannot read tensor {name}: {e}") from None

    def stream(dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        yield from build_mapped(plan, read, config, root, dtype)

    def select(dtype: torch.dtype, names: set) -> Iterator[tuple[str, torch.Tensor]]:
        yield from build_mapped([m for m in plan if m.target in names], read, config, root,
                                dtype)

    return Checkpoint(config=config, tokenizer_json=tokenizer_json, generation=generation,
                      _weights_digest=lambda: files_sha256(root, read_files),
                      source_desc=f"hf dir {root}", _stream=stream, _select=select)

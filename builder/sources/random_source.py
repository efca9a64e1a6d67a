"""Random weights for tests: config from the spec's `arch`, weights from a seeded generator.

`arch.model_type` picks the family (default llama); `arch.config` adds that family's other
config.json keys. Linear and embedding weights ~ N(0, 0.02), biases ~ N(0, 0.02), norm
weights 1 + N(0, 0.02) (near 1, not exactly, so a norm that is skipped shows). Parameters
are drawn in the family model's declaration order from one torch.Generator, so a seed always gives the same
model. weights_digest = sha256 of the canonical {arch, seed, tokenizer} JSON.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator, Optional

import torch

from kiln.builder.arch.config import DecoderConfig
from kiln.builder.arch.families import config_from_hf, param_shapes
from kiln.builder.sources.base import Checkpoint, CheckpointError
from kiln.builder.sources.tokenizer_build import byte_level

GENERATOR_VERSION = 1   # bump when the drawing scheme changes (changes every digest)


def config_from_arch(arch) -> DecoderConfig:
    """kiln.builder.spec.RandomArch -> DecoderConfig, read by the family of arch.model_type
    from a config.json made of the arch fields and arch.config."""
    cfg = arch.model_dump()
    extra, mtype = cfg.pop("config"), cfg.pop("model_type")
    mtype = mtype or ("qwen2" if cfg["attention_bias"] else "llama")
    hf = {"model_type": mtype, **cfg, **extra}
    try:
        return config_from_hf(hf)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"random: cannot make a model config from arch: {e}") from None


def open_random(arch, seed: int, tokenizer: Optional[str] = None) -> Checkpoint:
    config = config_from_arch(arch)
    if tokenizer:
        try:
            tokenizer_json = Path(tokenizer).read_text(encoding="utf-8")
        except OSError as e:
            raise CheckpointError(f"{tokenizer}: cannot read tokenizer: {e.strerror}") from None
        _check_vocab(tokenizer, tokenizer_json, config.vocab_size)
    else:
        tokenizer_json = byte_level(config.vocab_size, arch.bos_token_id, arch.eos_token_id)
    generation = {"bos_token_id": arch.bos_token_id, "eos_token_ids": [arch.eos_token_id],
                  "chat_template": None, "pad_token_id": arch.eos_token_id,
                  "add_bos_token": False}
    key = json.dumps({"arch": arch.model_dump(mode="json"), "seed": seed,
                      "generator": GENERATOR_VERSION,
                      "tokenizer": hashlib.sha256(tokenizer_json.encode()).hexdigest()},
                     sort_keys=True, separators=(",", ":"))
    shapes = param_shapes(config)

    def stream(dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        for name, shape in shapes.items():
            t = torch.randn(shape, generator=g) * 0.02
            if name.endswith("norm.weight"):
                t += 1.0
            yield name, t if dtype is None else t.to(dtype)

    return Checkpoint(config=config, tokenizer_json=tokenizer_json, generation=generation,
                      _weights_digest=hashlib.sha256(key.encode()).hexdigest(),
                      source_desc=f"random seed {seed}", _stream=stream)


def _check_vocab(path: str, tokenizer_json: str, vocab_size: int) -> None:
    """The tokenizer must not hold token ids the model has no embedding (or logit) for: text
    that tokenizes to one could not run, and output constraints mask over all its ids."""
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as e:
        raise CheckpointError(f"{path}: not a tokenizers JSON: {e}") from None
    n = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if n > vocab_size:
        raise CheckpointError(
            f"model.tokenizer {path} has {n} token ids but the model's arch.vocab_size is "
            f"{vocab_size}: ids {vocab_size}..{n - 1} would have no embedding. Give a "
            f"tokenizer of at most {vocab_size} ids, or set arch.vocab_size to at least {n}")

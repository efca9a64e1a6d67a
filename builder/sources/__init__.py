"""Checkpoint sources: a HF safetensors directory, a GGUF file, or random weights.

    ckpt = open_checkpoint(spec.model)       # config, tokenizer, generation, digest
    model = load_model(ckpt)                 # DecoderModel with every parameter filled once

Which source tensor feeds which parameter is declared by each family (builder/arch/families.py).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from kiln.builder.arch.blocks import DecoderModel, rope_inv_freq
from kiln.builder.arch.families import build_model
from kiln.builder.sources.base import Checkpoint, CheckpointError
from kiln.builder.uptodate import PKG_SCHEME, find_package_dir

__all__ = ["Checkpoint", "CheckpointError", "open_checkpoint", "resolve_source", "load_model"]



def _find_package_dir(package: str) -> Path:
    """The directory of an installed package, found on sys.path WITHOUT importing it."""
    path = find_package_dir(package)
    if path is None:
        raise CheckpointError(f"{PKG_SCHEME}{package}: package {package!r} is not "
                              "installed (or is not a package)")
    return path


def resolve_source(source: str) -> str:
    """`random`, `pkg://PACKAGE/FILE` or a local path -> `random` or an absolute local path.

    Raises CheckpointError when the file or directory does not exist.
    """
    if source == "random":
        return source
    if source.startswith(PKG_SCHEME):
        package, _, rel = source[len(PKG_SCHEME):].partition("/")
        if not package or not rel:
            raise CheckpointError(f"{source}: expected pkg://PACKAGE/FILE")
        path = _find_package_dir(package) / rel
        if not path.exists():
            raise CheckpointError(f"{source}: no file {rel!r} in package {package!r} "
                                  f"(looked at {path})")
        return str(path)
    if "://" in source:
        raise CheckpointError(f"{source}: unsupported scheme; use a local path, "
                              f"{PKG_SCHEME}PACKAGE/FILE or random (no hub downloads)")
    path = Path(os.path.expanduser(source)).absolute()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    return str(path)


def open_checkpoint(model) -> Checkpoint:
    """Open the checkpoint a spec's `model` section (builder.spec.ModelSpec) names.

    Reads config, tokenizer and tensor headers (not the weights); checks the name mapping
    and, when `model.revision` is set, the weights digest.
    """
    src = resolve_source(model.source)
    if src == "random":
        from kiln.builder.sources.random_source import open_random
        tok = resolve_source(model.tokenizer) if model.tokenizer else None
        ckpt = open_random(model.arch, model.seed, tok)
    else:
        path = Path(src)
        if path.is_dir():
            from kiln.builder.sources.hf import open_hf_dir
            ckpt = open_hf_dir(path)
        elif path.suffix == ".gguf" or _has_gguf_magic(path):
            from kiln.builder.sources.gguf_file import open_gguf
            ckpt = open_gguf(path)
        else:
            raise CheckpointError(f"{path}: not a checkpoint (expected a HF directory with "
                                  "config.json, or a .gguf file)")
    if model.revision and model.revision.lower() != ckpt.weights_digest:
        raise CheckpointError(f"{ckpt.source_desc}: weights digest {ckpt.weights_digest} "
                              f"differs from model.revision {model.revision}")
    if src != "random":      # a random model's tokenizer is checked against its arch
        _vet_vocabulary(ckpt)
    _vet_chat_template(ckpt)
    return ckpt


def _vet_vocabulary(ckpt: Checkpoint) -> None:
    """The tokenizer and the special ids must fit the model's vocabulary: an id past it has
    no embedding row and no logit (a tokenizer from another model, or a config that does not
    belong to these weights). Fewer token ids than rows is normal (padded embeddings)."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(ckpt.tokenizer_json)
    except Exception as e:
        raise CheckpointError(f"{ckpt.source_desc}: the tokenizer cannot be read: {e}") from None
    vocab = ckpt.config.vocab_size
    n = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if n > vocab:
        raise CheckpointError(
            f"{ckpt.source_desc}: the tokenizer has {n} token ids but the model's vocabulary "
            f"(vocab_size, the embedding's rows) is {vocab}: ids {vocab}..{n - 1} have no "
            "embedding. The tokenizer does not belong to these weights")
    gen = ckpt.generation
    special = {"bos_token_id": [gen.get("bos_token_id")],
               "eos_token_ids": list(gen.get("eos_token_ids") or [])}
    for key, ids in special.items():
        bad = [i for i in ids if i is not None and not 0 <= int(i) < vocab]
        if bad:
            raise CheckpointError(f"{ckpt.source_desc}: {key} {bad} outside the model's "
                                  f"vocabulary of {vocab} ids")


def _vet_chat_template(ckpt: Checkpoint) -> None:
    """A chat template that cannot render a sample conversation (user, assistant, user)
    within the runtime's limits is refused at build, not on the plan's first chat request."""
    if not ckpt.generation.get("chat_template"):
        return
    from tokenizers import Tokenizer as HFTokenizer

    from kiln.runtime.chat_template import ChatTemplateError, vet_chat_template
    from kiln.runtime.tokenizer import Tokenizer

    tok = Tokenizer(HFTokenizer.from_str(ckpt.tokenizer_json), ckpt.generation)
    try:
        vet_chat_template(tok.chat_template, tok.bos_token, tok.eos_token)
    except ChatTemplateError as e:
        raise CheckpointError(f"{ckpt.source_desc}: its chat template cannot be served: {e} "
                              "(rendering a sample conversation: user, assistant, user)")


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_model(ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
               progress=None, on_tensor=None, keep_source=None) -> DecoderModel:
    """The family's model (eval mode, no grad) with every parameter taken from ckpt.tensors().

    The model is built on the meta device; each streamed tensor is assigned to its
    parameter, so the weights exist once. Raises CheckpointError naming any tensor that
    is not a parameter, comes twice, has the wrong shape, or is never given. `progress`
    (a builder.progress.Progress) counts the tensors as they arrive; `on_tensor(model, name)`
    is called after each one is assigned (the streaming quantizer swaps finished linears);
    `keep_source(name)` True: that tensor stays in the checkpoint's dtype (bf16: the
    streaming quantizer widens a weight it packs a block of rows at a time, so an 8B model's
    128K x 4096 lm_head never exists in float32 whole).
    """
    with torch.device("meta"):
        model = build_model(ckpt.config)
    declared = {n: tuple(p.shape) for n, p in model.named_parameters()}
    filled: set[str] = set()
    for name, tensor in ckpt.tensors(None if keep_source else dtype):
        if name not in declared:
            raise CheckpointError(f"{ckpt.source_desc}: tensor {name} is not a parameter "
                                  "of the model")
        if name in filled:
            raise CheckpointError(f"{ckpt.source_desc}: tensor {name} given twice")
        if tuple(tensor.shape) != declared[name]:
            raise CheckpointError(f"{ckpt.source_desc}: tensor {name} has shape "
                                  f"{list(tensor.shape)}, the model declares "
                                  f"{list(declared[name])}")
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if not (keep_source and keep_source(name) and tensor.is_floating_point()):
            tensor = tensor.to(dtype)
        setattr(module, attr, nn.Parameter(tensor.contiguous(), requires_grad=False))
        filled.add(name)
        del tensor
        if on_tensor is not None:
            on_tensor(model, name)
        if progress is not None:
            progress.count("tensors", len(filled), len(declared))
    missing = [n for n in declared if n not in filled]
    if missing:
        raise CheckpointError(f"{ckpt.source_desc}: missing tensors: {', '.join(missing)}")
    model.register_buffer("inv_freq", rope_inv_freq(ckpt.config), persistent=False)
    return model.eval()

"""The accuracy gate's fp32 reference computed one decoder layer at a time.

The eager reference (runtime/accuracy_gate.py `evaluate` on the whole fp32 model) holds every
weight at once: 4 bytes a parameter, 32 GB at 8B. The evaluation's activations are small
(eval_tokens x hidden floats: 20480 x 4096 x 4 = 336 MB at 8B), so this computes the same
numbers the other way round: every window's hidden states go through layer 0, then layer 1 ...
with one layer's fp32 weights in memory at a time.

    h[w] = embed(window w)                    for every window (the embedding, then freed)
    for each layer i:  load layer i  ->  h[w] = layer_i(h[w]) for every window  ->  free it
    for each window:   logits = lm_head(norm(h[w][:-1]))  -> nll, top-1 (one window's rows)

Each window is the same fresh sequence `evaluate` packs (ModelInput.build: positions 0..W-1,
its own KV pool of one layer, causal attention through kiln::paged_attention), and the
layers are the family's own modules, so GQA, RoPE (Llama 3 scaling, LongRoPE), sliding
windows, q/k norms and experts are the model's code, not a copy. The model's step is split
into prologue / layers / epilogue here for the families whose forward is DecoderModel's
(Llama, Mistral, Qwen2/3, Phi3, Mixtral, Qwen3-MoE) and Gemma's; another model class
returns None from `supported` and the caller takes the whole-model path.

Weights come from Checkpoint.tensors_of (safetensors and GGUF read just the named tensors);
a source that cannot select (random weights, drawn in order) is streamed once, each layer
taken as it completes, so it holds one layer too (its embedding stays for a tied head).
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Iterator, Sequence

import torch
from torch import nn

from kiln.builder.arch.blocks import DecoderModel, StepInputs, rope_inv_freq
from kiln.builder.arch.families import build_model
from kiln.builder.arch.gemma import GemmaModel, _cos_sin
from kiln.plugins.paged_kv import kv_format
from kiln.runtime import accuracy_gate as racc
from kiln.runtime.executor import ModelInput

_LAYER = re.compile(r"layers\.(\d+)\.")


def supported(cfg) -> bool:
    """Whether the family's step splits into prologue / layers / epilogue here."""
    with torch.device("meta"):
        model = build_model(cfg)
    return type(model) in (DecoderModel, GemmaModel)


def groups(model: nn.Module) -> list[set[str]]:
    """Parameter names in load order: [embedding, layer 0 .. layer L-1, final norm + head
    (+ the embedding again for a tied head)]."""
    out: list[set[str]] = [set() for _ in range(len(model.layers) + 2)]
    for name, _ in model.named_parameters():
        m = _LAYER.match(name)
        out[int(m.group(1)) + 1 if m else 0 if name.startswith("tok_embeddings.")
            else -1].add(name)
    if model.output is None:
        out[-1] |= out[0]
    return out


def by_group(ckpt, gs: list[set[str]]) -> Iterator[dict[str, torch.Tensor]]:
    """Each group's fp32 tensors in turn: selected reads, or one pass of the stream."""
    if ckpt.tensors_of(set()) is not None:
        for g in gs:
            yield dict(ckpt.tensors_of(g))
        return
    have: dict[str, torch.Tensor] = {}
    i = 0
    for name, t in ckpt.tensors(torch.float32):
        have[name] = t
        while i < len(gs) and gs[i] <= have.keys():
            yield {n: have[n] for n in gs[i]}
            keep = set().union(*gs[i + 1:])
            have = {n: v for n, v in have.items() if n in keep}
            i += 1
    if i < len(gs):
        missing = sorted(set().union(*gs[i:]) - have.keys())
        raise ValueError(f"{ckpt.source_desc}: missing tensors: {', '.join(missing)}")


def _fill(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(t.contiguous(),
                                                               requires_grad=False))


def _free(module: nn.Module) -> None:
    """Back to the meta device: the module's weights are dropped."""
    module.to_empty(device="meta")


def _steps(model: nn.Module, win: Sequence[int], tokens_per_block: int
           ) -> tuple[ModelInput, dict[bool, StepInputs]]:
    """The window's packed step (as `evaluate` packs it) and its StepInputs, keyed by
    whether the layer is local (Gemma's local RoPE tables; one entry elsewhere)."""
    blocks = -(-len(win) // tokens_per_block)
    inp = ModelInput.build([win], [0], [list(range(1, blocks + 1))], tokens_per_block,
                           logits_indices=range(len(win) - 1))
    base = (inp.positions, inp.slot_mapping, inp.block_tables, inp.context_lens,
            inp.query_start_loc)
    if isinstance(model, GemmaModel):
        glob = StepInputs(*base, *_cos_sin(inp.positions, model.rope_global))
        return inp, {False: glob, True: replace(glob, **dict(zip(
            ("cos", "sin"), _cos_sin(inp.positions, model.rope_local))))}
    freqs = inp.positions.float()[:, None] * model.inv_freq[None, :]       # [T, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                    # [T, 1, R]
    cos, sin = emb.cos(), emb.sin()
    if model.rope_scale != 1.0:
        cos, sin = cos * model.rope_scale, sin * model.rope_scale
    s = StepInputs(*base, cos, sin)
    return inp, {False: s, True: s}


def _logits(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The epilogue of the model's step on the rows h [N, hidden] -> [N, vocab] float32."""
    logits = model.lm_head(model.norm(h)).float()
    c = model.cfg.final_logit_softcap if isinstance(model, GemmaModel) else None
    return logits if not c else c * torch.tanh(logits / c)


@torch.inference_mode()
def evaluate_layerwise(ckpt, ids: Sequence[int], window: int, tokens_per_block: int = 16,
                       progress=None) -> racc.EvalResult:
    """`evaluate`'s result for the eager fp32 model of ckpt, one layer's weights at a time."""
    cfg = ckpt.config
    with torch.device("meta"):
        model = build_model(cfg)
    if not isinstance(model, GemmaModel):        # DecoderModel's rope table: real values
        model.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
    gs = groups(model)
    wins = racc.windows(ids, window)
    steps = [_steps(model, w, tokens_per_block) for w in wins]
    blocks = -(-window // tokens_per_block)
    kc, vc = kv_format.new_pools("fp32", 1, blocks + 1, tokens_per_block, cfg.num_kv_heads,
                                 cfg.head_dim, "cpu")
    loaded = by_group(ckpt, gs)
    _fill(model, next(loaded))
    scale = getattr(model, "embed_scale", None)
    hs = []
    for inp, _ in steps:
        x = model.tok_embeddings(inp.input_ids)                          # [W, hidden]
        hs.append(x * scale.to(x.dtype) if scale is not None else x)
    _free(model.tok_embeddings)
    for i, layer in enumerate(model.layers):
        _fill(model, next(loaded))
        local = bool(getattr(layer, "local", False))
        hs = [layer(x, s[local], kc[0], vc[0]) for x, (_, s) in zip(hs, steps)]
        _free(layer)
        if progress is not None:
            progress.count("layers", i + 1, len(model.layers))
    _fill(model, next(loaded))
    nll, count, top1 = 0.0, 0, []
    for x, w, (inp, _) in zip(hs, wins, steps):
        s, am = racc.score_logits(_logits(model, x[inp.logits_indices]), torch.tensor(w[1:]))
        nll, count, top1 = nll + s, count + len(w) - 1, top1 + am
    return racc.EvalResult(nll, count, top1)


def peak_bytes(cfg, n_tokens: int) -> int:
    """What the layerwise reference holds at most: the largest group's fp32 weights plus
    every evaluation token's hidden state (twice, while a layer maps them)."""
    shapes = {}
    with torch.device("meta"):
        model = build_model(cfg)
    for name, p in model.named_parameters():
        shapes[name] = 4 * math.prod(p.shape)
    largest = max(sum(shapes[n] for n in g) for g in groups(model))
    return largest + 2 * 4 * n_tokens * cfg.hidden_size

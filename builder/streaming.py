"""Load and quantize in one pass: each linear is packed as soon as its tensors are loaded.

    model, record = load_quantized(ckpt, precision, device, progress)

The model is built on the meta device and filled tensor by tensor from the checkpoint's
stream (safetensors shards and GGUF files are memory-mapped; one tensor is read at a time).
The weights it packs stay in the checkpoint's dtype (bf16 for most) until then, and are
widened to float32 a block of rows at a time as they are quantized (exactly: the same
values). When the last tensor of a linear arrives it is swapped for its QuantLinear, and its
weight is dropped; the embedding is packed when it arrives (with the tied lm_head that reads
its table). The builder then holds the packed weights plus one source tensor, not the whole
float32 model. The result is the model and record quantize_model gives for the same
arguments without calibration (round to nearest); calibrated schemes need the float model's
activations and take the eager path (builder/build.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from kiln.builder import quantize as q
from kiln.contracts import FieldError
from kiln.contracts.manifest import QuantizationRecord
from kiln.plugins.quant import formats
from kiln.plugins.quant.modules import QuantEmbedding


EMBEDDING_ROWS = 8192     # rows of the embedding quantized at a time


def embedding_by_rows(w: torch.Tensor, scheme: str, rows: int = EMBEDDING_ROWS
                      ) -> QuantEmbedding:
    """QuantEmbedding.from_embedding's table, made `rows` rows at a time into preallocated
    buffers: each row's format depends on that row alone (int8: one scale per row), so the
    result is the same, without whole-table float temporaries (128K x 2048: 1 GB each)."""
    first = formats.quantize(w[:rows], scheme)
    q = torch.empty((w.shape[0], w.shape[1]), dtype=first.qweight.dtype)
    s = None if first.scales is None else torch.empty(w.shape[0], dtype=first.scales.dtype)
    for i in range(0, w.shape[0], rows):
        part = first if i == 0 else formats.quantize(w[i:i + rows], scheme)
        q[i:i + rows] = part.qweight
        if s is not None:
            s[i:i + rows] = part.scales
    return QuantEmbedding(q, s)


class _StreamQuantizer:
    """Swaps each target linear of a meta-built model once all its parameters are loaded."""

    def __init__(self, model: nn.Module, weights: str, group_size: Optional[int],
                 keep: tuple[str, ...], activations: str, device: str):
        q._check_args(weights, group_size)
        q._check_keep(model, keep)
        linears = q._targets(model, keep)
        self.order = list(linears)             # quantize_model's order, for the record
        self.tied = getattr(model, "output", None) is None
        self.head = q.LM_HEAD not in keep
        heads = {"output": q._InputDim(model.cfg.hidden_size)} if self.head else {}
        self.experts = q._experts(model, keep)
        if self.experts and device != "cpu" and weights not in ("fp32", "bf16"):
            msg = f"{weights} experts have no GPU kernel; use bf16, or a CPU target"
            raise FieldError("weights", msg, msg)
        self.scheme = q.choose_scheme(weights, group_size, keep, activations, device,
                                      dict(linears, **heads, **q._experts_k(self.experts)))
        # linear name -> its parameters still to come (only names: a module held here would
        # keep its float32 weight alive after the swap)
        self.pending = {n: {p for p, _ in m.named_parameters()} for n, m in linears.items()}
        if self.head and not self.tied:
            self.pending["output"] = {p for p, _ in model.output.named_parameters()}
        self.done = q._Swapped()
        self.qemb: Optional[QuantEmbedding] = None

    def keeps_source(self, name: str) -> bool:
        """Whether load_model may leave the tensor `name` in the checkpoint's dtype: the weight
        of a linear packed as soon as it completes, and an embedding packed when it arrives
        (never a table the model keeps, or a norm)."""
        owner, _, attr = name.rpartition(".")
        if owner == "tok_embeddings":
            return self.scheme.embedding is not None and not (self.tied and not self.head)
        return attr == "weight" and owner in self.pending

    def tensor_loaded(self, model: nn.Module, name: str) -> None:
        """load_model's on_tensor: swap the linear (or embedding) `name` completes."""
        owner, _, attr = name.rpartition(".")
        if owner == "tok_embeddings":
            self._embedding(model)
            return
        left = self.pending.get(owner)
        if left is None:
            return
        left.discard(attr)
        if not left:
            del self.pending[owner]
            # qemb None: only the tied head reads the packed table (_tied_head)
            q._swap_linears(model, {owner: model.get_submodule(owner)}, self.scheme, {},
                            None, self.done)

    def _embedding(self, model: nn.Module) -> None:
        """Pack the embedding now where nothing needs its float table later: a tied lm_head
        that is quantized reads the packed table (quantize_model's rule); a kept tied head
        needs the float table, so the embedding waits for finish()."""
        if self.scheme.embedding is None or (self.tied and not self.head):
            if self.tied and self.head:       # kept embedding, quantized tied head
                self._tied_head(model)
            return
        emb = model.tok_embeddings
        self.qemb = embedding_by_rows(emb.weight.detach(), self.scheme.embedding)
        self.done.bytes_before += q.fp32_bytes(emb.weight)
        self.done.bytes_after += q._nbytes(self.qemb.buffers())
        if self.tied:
            self._tied_head(model)
        model.tok_embeddings = self.qemb

    def _tied_head(self, model: nn.Module) -> None:
        q._swap_linears(model, {"output": q._lm_head(model, self.scheme.keep)}, self.scheme,
                        {}, self.qemb, self.done)

    def finish(self, model: nn.Module) -> QuantizationRecord:
        """After the last tensor: the deferred embedding, the experts; -> the record."""
        if self.pending:
            raise RuntimeError(f"linears never completed: {sorted(self.pending)}")
        if self.scheme.embedding is not None and self.qemb is None:
            self.qemb = QuantEmbedding.from_embedding(model.tok_embeddings,
                                                      self.scheme.embedding)
            self.done.bytes_before += q._nbytes([model.tok_embeddings.weight])
            self.done.bytes_after += q._nbytes(self.qemb.buffers())
            model.tok_embeddings = self.qemb
        q._swap_experts(model, self.experts, self.scheme, self.done)
        if self.qemb is not None:
            self.done.quantized.append("tok_embeddings")
        rank = {n: i for i, n in enumerate([*self.order, "output", *self.experts,
                                            "tok_embeddings"])}
        self.done.quantized.sort(key=rank.__getitem__)
        method = "none" if self.scheme.weights == "fp32" else "rtn"
        return q.quantization_record(self.scheme, self.done, method, False)


def load_quantized(ckpt, weights: str, group_size: Optional[int], keep: tuple[str, ...],
                   activations: str, device: str, progress=None
                   ) -> tuple[nn.Module, QuantizationRecord]:
    """The checkpoint's model with its linears packed as they load (quantize_model's
    arguments, no calibration) -> (model, the quantization record)."""
    from kiln.builder.arch.families import build_model
    from kiln.builder.sources import load_model

    with torch.device("meta"):
        shape_model = build_model(ckpt.config)
    sq = _StreamQuantizer(shape_model, weights, group_size, keep, activations, device)
    del shape_model       # load_model builds its own; the quantizer kept only names
    model = load_model(ckpt, dtype=torch.float32, progress=progress,
                       on_tensor=sq.tensor_loaded, keep_source=sq.keeps_source)
    return model, sq.finish(model)


def streams(spec, cfg) -> bool:
    """Whether a build of this spec loads and quantizes in one pass: packed weights without
    calibration (AWQ / SmoothQuant need the float model's activations on calibration text),
    on a dense model (cfg: the checkpoint's DecoderConfig). Mixture-of-experts layers are
    packed by quantize_model's QuantExperts, which the tensor-by-tensor path does not build:
    they load whole, then quantize."""
    return (spec.packed_weights and spec.accuracy.calibration_text is None
            and not getattr(cfg, "num_experts", 0))


def load_quantized_for(spec, ckpt, progress) -> tuple[nn.Module, QuantizationRecord]:
    """load_quantized with the spec's precision; a bad precision field -> SpecError."""
    from kiln.builder.spec import SpecError

    p = spec.precision
    keep = () if p.weights in ("bf16", "fp32") else p.keep_high_precision
    acts = "int8" if p.activations == "int8" else "float"
    progress.stage(f"loading weights and quantizing to {p.weights}"
                   + (" + int8 activations" if acts == "int8" else "")
                   + f", one tensor at a time: {ckpt.source_desc}")
    try:
        model, record = load_quantized(ckpt, p.weights, p.group_size, keep, acts,
                                       spec.target.device, progress)
    except ValueError as e:    # FieldError: the quantize argument = the precision field
        if not isinstance(e, FieldError):
            raise
        raise SpecError(spec.name, [(f"precision.{e.field}", str(e))]) from None
    model.eval()
    return model, dataclasses.replace(record, group_size_source=(
        "spec" if p.group_size is not None else "auto" if p.weights == "int4" else None))

"""Quantization as a transform of a plain model (STYLE.md 7): swap nn.Linear for QuantLinear.

    record = quantize_model(model, "int4", group_size=64, calibration=run_calibration)
        choose_scheme(...)  -> QuantScheme   the decision, from the arguments and the linears' K
        _swap_linears(...)                   the swap loop (scale searches, the tied head)
        -> QuantizationRecord                what was done: plan.json precision.quantization

The model file knows nothing of packing; this module knows nothing of the architecture beyond
two names: the token embedding (`tok_embeddings`) and the lm_head (the `output` Linear, or the
tied embedding matrix). Mixture-of-experts layers' experts (plugins/moe/modules.Experts) are
swapped for QuantExperts in the same weight format, round to nearest.

Layers named in keep_high_precision keep their float dtype. The embedding, when not kept, is
stored int8 per row (QuantEmbedding: a gather needs a per-row format; bf16 at bf16); the
lm_head, when not kept, in the plan's scheme — except a tied lm_head, which reads the
embedding's table (int8, or bf16 at bf16).

AWQ-style calibration (int4): for each linear, per-input-channel scales s = mean|x|^alpha
(normalized) are searched over alpha on the linear's calibration inputs, minimizing the error
of x @ W.T against the quantized (W * s) with x / s; alpha = 0 is plain round-to-nearest, so
the search never does worse than RTN on the calibration data. x / s is kept as the module's
`input_scale` (a multiply Inductor fuses into the producer of x). Activations are collected
once from the unquantized model (not layer by layer as in the AWQ paper).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Union

import torch
from torch import nn

from kiln.contracts import FieldError
from kiln.contracts.manifest import QuantizationRecord
from kiln.plugins.moe.modules import Experts, QuantExperts
from kiln.plugins.quant import formats
from kiln.plugins.quant.modules import QuantEmbedding, QuantLinear

EMBED, LM_HEAD = "embed", "lm_head"
AWQ_ALPHAS = tuple(i / 10 for i in range(11))
AWQ_MAX_ROWS = 512          # calibration rows kept per linear
Calibration = Union[Callable[[nn.Module], None], Mapping[str, torch.Tensor]]


def _kept(name: str, keep: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return any(k == name or name.startswith(k + ".") or k in parts for k in keep)


def _targets(model: nn.Module, keep: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The nn.Linear modules to quantize, by qualified name (lm_head handled separately; a
    linear whose class says `quantize = False`, an MoE router, stays float)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and getattr(m, "quantize", True) and n != "output"
            and not _kept(n, keep)}


def _resolve_group_size(group_size: Optional[int], linears: dict[str, nn.Linear]) -> int:
    """An explicit group_size must divide every K; None picks the largest allowed that does."""
    ks = {m.in_features for m in linears.values()}
    if group_size is not None:
        for name, m in linears.items():
            try:
                formats.check_group_size(m.in_features, group_size)
            except ValueError as e:
                raise FieldError("group_size", f"{name}: {e}", f"{name}: {e}") from None
        return group_size
    for g in sorted(formats.GROUP_SIZES, reverse=True):
        if all(k % g == 0 for k in ks):
            return g
    message = (f"no int4 group_size in {formats.GROUP_SIZES} divides every linear's "
               f"input dim {sorted(ks)}")
    raise FieldError("group_size", message, message)


def collect_inputs(model: nn.Module, linears: dict[str, nn.Linear],
                   run: Callable[[nn.Module], None], max_rows: int = AWQ_MAX_ROWS
                   ) -> dict[str, torch.Tensor]:
    """Runs `run(model)` with hooks that record each linear's inputs -> name: [rows, K]."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in linears}

    def hook(name):
        def f(_mod, args):
            seen[name].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
        return f

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for n, xs in seen.items():
        if xs:
            x = torch.cat(xs)
            if x.shape[0] > max_rows:
                idx = torch.linspace(0, x.shape[0] - 1, max_rows).long()
                x = x[idx]
            out[n] = x
    return out


def awq_search(w: torch.Tensor, x: torch.Tensor, scheme: str, group_size: Optional[int]
               ) -> tuple[torch.Tensor, float]:
    """-> (input_scale [K] = 1/s for the best alpha, alpha). w [N, K]; x [rows, K]."""
    w = w.detach().float()
    x = x.float()
    ref = x @ w.T
    mag = x.abs().mean(dim=0).clamp_min(1e-6)
    best = (float("inf"), torch.ones_like(mag), 0.0)
    for alpha in AWQ_ALPHAS:
        s = mag.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        wq = formats.dequantize(formats.quantize(w * s[None, :], scheme, group_size))
        err = ((x / s[None, :]) @ wq.T - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, 1.0 / s, alpha)
    return best[1], best[2]


def smooth_search(w: torch.Tensor, x: torch.Tensor) -> tuple[Optional[torch.Tensor], float]:
    """SmoothQuant for W8A8: -> (input_scale [K] = 1/s, alpha), or (None, -1) when no
    smoothing beats none. s_j = max|x_j|^alpha / max|w_j|^(1 - alpha) moves the activations'
    outlier channels into the weights (W * s, x / s: the product is unchanged before
    rounding); alpha is searched on the linear's calibration inputs, minimizing the error of
    the W8A8 product against the float one."""
    from kiln.plugins.quant import ops

    w = w.detach().float()
    x = x.float()
    ref = x @ w.T

    def err(xs, ws):
        qw = formats.quantize(ws, "int8")
        return (ops.linear_int8_a8_reference(xs, qw.qweight, qw.scales) - ref).pow(2).mean().item()

    xmax = x.abs().amax(dim=0).clamp_min(1e-5)
    wmax = w.abs().amax(dim=0).clamp_min(1e-5)
    best = (err(x, w), None, -1.0)
    for alpha in AWQ_ALPHAS[1:]:
        s = xmax.pow(alpha) / wmax.pow(1 - alpha)
        s = s / (s.max() * s.min()).sqrt()
        e = err(x / s[None, :], w * s[None, :])
        if e < best[0]:
            best = (e, 1.0 / s, alpha)
    return best[1], best[2]


@dataclass(frozen=True)
class QuantScheme:
    """What quantize_model does, decided from its arguments and the linears' shapes alone."""
    weights: str                 # the spec's precision.weights (formats.SCHEMES)
    layer: str                   # the linears' format: weights', or int4_a8 (W4A8, rows16)
    group_size: Optional[int]    # int4 / int4_a8 group; None otherwise
    rows16: bool                 # int4 weight-only at group 32 on the CPU: the interleaved
                                 # format per linear where its weight fits (else [N, K/2])
    activations: str             # float | int8
    calibrated: Optional[str]    # what calibration inputs are for: awq | smoothquant | None
    keep: tuple[str, ...]        # keep_high_precision

    @property
    def embedding(self) -> Optional[str]:
        """The embedding's storage when it is quantized (None: kept float)."""
        if EMBED in self.keep:
            return None
        return self.weights if self.weights in ("bf16", "fp32") else "int8"

    @property
    def activation_format(self) -> str:
        return ("float" if self.activations == "float" else
                "int8-per-group-32-dynamic" if self.layer == "int4_a8" else
                "int8-per-token-dynamic")


def choose_scheme(weights: str, group_size: Optional[int], keep: tuple[str, ...],
                  activations: str, device: str, linears: dict[str, nn.Linear]) -> QuantScheme:
    """The scheme for these arguments (quantize_model's); reads only the linears' K."""
    _check_args(weights, group_size)
    # W4A8: the int4 linears take the interleaved group-minimum format of the W4A8 kernel
    # (round-to-nearest: a Q4_1 GGUF's weights come back exactly); the head stays int8 W8A8.
    # int4 weight-only on the CPU at group 32: the same format, float activations
    # (kiln::linear_int4_rows16, 1.4-2.9x the [N, K/2] layout's decoder on SmolLM2's shapes).
    layer = "int4_a8" if weights == "int4" and activations == "int8" else weights
    gs = (formats.INT4_A8_GROUP if layer == "int4_a8" else
          _resolve_group_size(group_size, linears) if weights == "int4" else None)
    # Decided per linear, on the weight as it is quantized (after any AWQ scale): one that
    # does not fit (rows not a multiple of 16, |w| beyond float16) keeps the [N, K/2] layout.
    rows16 = layer == "int4" and device == "cpu" and gs == formats.INT4_A8_GROUP
    if rows16:
        layer = "int4_a8"
    calibrated = ("awq" if weights == "int4" and activations == "float" else
                  "smoothquant" if layer == "int8" and activations == "int8" else None)
    return QuantScheme(weights, layer, gs, rows16, activations, calibrated, keep)


@dataclass
class _Swapped:
    """What the swap loop did (becomes the QuantizationRecord)."""
    quantized: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    awq_alpha: dict[str, float] = field(default_factory=dict)
    smooth_alpha: dict[str, float] = field(default_factory=dict)
    lm_head: Optional[str] = None
    layout_kept: list[str] = field(default_factory=list)   # int4 linears left in [N, K/2]
    rows16_used: bool = False


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def fp32_bytes(weight: torch.Tensor) -> int:
    """A weight's bytes in float32 (the record's "before"), whatever dtype it arrived in."""
    return weight.numel() * 4


def quantize_model(model: nn.Module, weights: str, group_size: Optional[int] = None,
                   keep_high_precision: tuple[str, ...] = (EMBED, LM_HEAD),
                   calibration: Optional[Calibration] = None, activations: str = "float",
                   device: str = "cpu") -> QuantizationRecord:
    """Swaps the model's nn.Linear modules for QuantLinear in place; returns what it did.

    weights: int8 | int4 | fp8 | bf16 (weight-only: bf16 storage, float32 compute) | fp32
    (nothing quantized: every linear and the tied head run the plugin's streaming GEMV).
    group_size: int4 only (None: the largest of 128/64/32 that
    divides every quantized linear's K). keep_high_precision: "embed", "lm_head", or module
    names / name components ("w2", "layers.0") left unquantized. calibration (int4): a
    callable run(model) that runs the unquantized model on calibration inputs, or a mapping
    linear name -> its inputs [rows, K]; enables the AWQ-style scale search. activations
    "int8": with int8 weights every quantized linear, the lm_head included, runs W8A8; with
    int4 weights the linears run W4A8 (formats "int4_a8", group 32) and a tied lm_head W8A8
    on the embedding's int8 table. device: the plan's target; on "cpu", int4 weight-only at
    group 32 stores the same interleaved format and runs kiln::linear_int4_rows16; a linear
    that does not fit it (N % 16 != 0, or its AWQ-scaled |w| beyond float16) keeps the
    [N, K/2] layout and is named in the report's `int4_layout_kept`. A bad argument raises
    FieldError naming it (`group_size`).
    """
    keep = tuple(keep_high_precision)
    _check_args(weights, group_size)
    _check_keep(model, keep)
    linears = _targets(model, keep)
    head = _lm_head(model, keep)
    all_q = dict(linears, **({"output": head} if head is not None else {}))
    experts = _experts(model, keep)
    if experts and device != "cpu" and weights not in ("fp32", "bf16"):
        msg = (f"{weights} experts ({next(iter(experts))}) have no GPU kernel (the Triton "
               "experts pass reads float32 / bfloat16 weights); use bf16, or a CPU target")
        raise FieldError("weights", msg, msg)
    scheme = choose_scheme(weights, group_size, keep, activations, device,
                           dict(all_q, **_experts_k(experts)))
    acts: dict[str, torch.Tensor] = {}
    method = "none" if weights == "fp32" else "rtn"   # fp32: the linears run the plugin's GEMV
    if calibration is not None and scheme.calibrated:
        acts = (dict(calibration) if isinstance(calibration, Mapping)
                else collect_inputs(model, linears, calibration))
        method = scheme.calibrated
    done = _Swapped()
    qemb = None
    if scheme.embedding is not None:
        emb = model.tok_embeddings
        qemb = QuantEmbedding.from_embedding(emb, scheme.embedding)
        done.bytes_before += _nbytes([emb.weight])
        done.bytes_after += _nbytes(qemb.buffers())
    _swap_linears(model, all_q, scheme, acts, qemb, done)
    _swap_experts(model, experts, scheme, done)
    if qemb is not None:
        model.tok_embeddings = qemb
        done.quantized.append("tok_embeddings")
    return quantization_record(scheme, done, method, calibration is not None)


def quantization_record(scheme: QuantScheme, done: "_Swapped", method: str,
                        calibration_given: bool) -> QuantizationRecord:
    """What quantize_model (or the streaming load, builder/streaming.py) did, for plan.json."""
    weights, keep = scheme.weights, scheme.keep
    return QuantizationRecord(
        weights=weights,
        # int4 on rows16 where not one linear fit the interleaved format: plain int4
        scheme="int4" if scheme.rows16 and not done.rows16_used else scheme.layer,
        group_size=scheme.group_size, method=method, activations=scheme.activation_format,
        kept=tuple(sorted(set(keep))), quantized=tuple(done.quantized),
        awq_alpha=done.awq_alpha,
        embedding=("float" if scheme.embedding is None else
                   weights if weights in ("bf16", "fp32") else "int8-per-row"),
        bytes_before=done.bytes_before, bytes_after=done.bytes_after,
        smooth_alpha=done.smooth_alpha or None, lm_head=done.lm_head,
        int4_layout_kept=tuple(done.layout_kept) or None,
        # fp8: stored E4M3, this CPU kernel upcasts (no FP8 MMA); bf16: stored bf16,
        # multiplied in float32 (no bf16 FMA on AVX2)
        fp8_compute="upcast-fp32" if weights == "fp8" else None,
        bf16_compute="upcast-fp32" if weights == "bf16" else None,
        calibration=(None if not calibration_given or scheme.calibrated else
                     "not used: AWQ scale search applies to int4 weight-only, "
                     "SmoothQuant to int8 weights with int8 activations"))


@dataclass(frozen=True)
class _InputDim:
    in_features: int     # a K the int4 group size must divide (the experts' H and I)


def _experts(model: nn.Module, keep: tuple[str, ...]) -> dict[str, Experts]:
    """The mixture-of-experts layers' float experts to quantize, by qualified name."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, Experts) and not _kept(n, keep)}


def _experts_k(experts: dict[str, Experts]) -> dict[str, _InputDim]:
    return {f"{n}.{w}": _InputDim(k) for n, e in experts.items()
            for w, k in (("w13", e.hidden), ("w2", e.inter))}


def _swap_experts(model: nn.Module, experts: dict[str, Experts], scheme: QuantScheme,
                  done: "_Swapped") -> None:
    """Replace each float Experts by QuantExperts in the linears' weight format (round to
    nearest; int4 in the [N, K/2] layout at the plan's group size). With int8 activations:
    W8A8 int8 experts, W4A8 int4 experts at group 32 (no SmoothQuant scales). fp32 leaves
    them as they are."""
    if scheme.weights == "fp32" or not experts:
        return
    for name, e in experts.items():
        q = QuantExperts.from_experts(e, scheme.weights, scheme.group_size, scheme.activations)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, q)
        done.quantized.append(name)
        done.bytes_before += _nbytes([e.w13, e.w2])
        done.bytes_after += _nbytes(q.buffers())


def _check_args(weights: str, group_size: Optional[int]) -> None:
    if weights not in formats.SCHEMES:
        raise FieldError("weights", f"{weights!r}: allowed: {formats.SCHEMES}",
                         f"quantize_model weights={weights!r}; allowed: {formats.SCHEMES}")
    if group_size is not None and weights != "int4":
        raise FieldError("group_size", f"applies to int4 only (weights={weights!r})")


def _check_keep(model: nn.Module, keep: tuple[str, ...]) -> None:
    names = [n for n, _ in model.named_modules()]
    for k in keep:
        if k not in (EMBED, LM_HEAD) and not any(_kept(n, (k,)) for n in names):
            raise FieldError("keep_high_precision", f"entry {k!r} matches no module")


def _lm_head(model: nn.Module, keep: tuple[str, ...]) -> Optional[nn.Linear]:
    """The lm_head to quantize (None: kept); a tied one gets its own Linear over the
    embedding's weight (the embedding stays)."""
    if LM_HEAD in keep:
        return None
    out = getattr(model, "output", None)
    if out is None:
        emb = model.tok_embeddings.weight
        with torch.device("meta"):     # no initialized [vocab, hidden] weight to throw away
            out = nn.Linear(emb.shape[1], emb.shape[0], bias=False)
        out.weight = emb
    return out


def _swap_linears(model: nn.Module, all_q: dict[str, nn.Linear], scheme: QuantScheme,
                  acts: dict[str, torch.Tensor], qemb: Optional[QuantEmbedding],
                  done: _Swapped) -> None:
    """Replace each linear of all_q by its QuantLinear (searching its scale on its
    calibration inputs, if any); accounts for each in `done`."""
    for name, lin in all_q.items():
        scale = None
        if name in acts and scheme.activations == "int8":
            scale, done.smooth_alpha[name] = smooth_search(lin.weight, acts[name])
        elif name in acts:
            scale, done.awq_alpha[name] = awq_search(lin.weight, acts[name], scheme.weights,
                                                     scheme.group_size)
        if name == "output" and qemb is not None and scale is None \
                and lin.weight is model.tok_embeddings.weight:
            # Tied: the head reads the embedding's table (int8 whatever the plan's scheme:
            # an int4 head costs SmolLM2 +31% perplexity, int8 rows ~0.2%; bf16 at bf16).
            # With int8 activations it runs W8A8 unsmoothed (a shared table cannot take
            # SmoothQuant's scales): SmolLM2 +1.90% perplexity, against +0.80% with a
            # weight-only head, which made the batch-32 step 1.4x slower.
            q = QuantLinear(formats.QuantizedWeight(qemb.scheme, qemb.qweight, qemb.scales,
                                                    None, None, tuple(lin.weight.shape)),
                            activations=scheme.activations)
            done.lm_head = f"{qemb.scheme} (the tied embedding's table)"
        else:
            layer = scheme.layer
            w = lin.weight.detach()     # float32, or a streamed build's bf16 (exact values)
            if scheme.rows16 and not formats.fits_int4_a8(
                    w if scale is None else w.float() / scale[None, :]):
                layer = "int4"
                done.layout_kept.append(name)
            done.rows16_used = done.rows16_used or layer == "int4_a8"
            q = QuantLinear.from_linear(lin, layer, scheme.group_size, scale,
                                        scheme.activations)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, q)
        done.quantized.append(name)
        done.bytes_before += fp32_bytes(lin.weight)
        shared = qemb is not None and q.qweight is qemb.qweight
        done.bytes_after += 0 if shared else _nbytes(q.buffers())

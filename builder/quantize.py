"""Quantization as a transform of a plain model (STYLE.md 7): swap nn.Linear for QuantLinear.

    report = quantize_model(model, "int4", group_size=64, calibration=run_calibration)

The model file knows nothing of packing; this module knows nothing of the architecture beyond
two names: the token embedding (`tok_embeddings`) and the lm_head (the `output` Linear, or the
tied embedding matrix). The returned dict describes what was done and goes into the plan
manifest (precision.quantization).

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

from typing import Callable, Mapping, Optional, Union

import torch
from torch import nn

from kiln.contracts import FieldError
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
    """The nn.Linear modules to quantize, by qualified name (lm_head handled separately)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n != "output" and not _kept(n, keep)}


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


def quantize_model(model: nn.Module, weights: str, group_size: Optional[int] = None,
                   keep_high_precision: tuple[str, ...] = (EMBED, LM_HEAD),
                   calibration: Optional[Calibration] = None, activations: str = "float",
                   device: str = "cpu") -> dict:
    """Swaps the model's nn.Linear modules for QuantLinear in place; returns a report dict.

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
    [N, K/2] layout and is named in the report's "int4_layout_kept". A bad argument raises
    FieldError naming it (`group_size`).
    """
    if weights not in formats.SCHEMES:
        raise FieldError("weights", f"{weights!r}: allowed: {formats.SCHEMES}",
                         f"quantize_model weights={weights!r}; allowed: {formats.SCHEMES}")
    keep = tuple(keep_high_precision)
    if group_size is not None and weights != "int4":
        raise FieldError("group_size", f"applies to int4 only (weights={weights!r})")
    linears = _targets(model, keep)
    names = [n for n, _ in model.named_modules()]
    for k in keep:
        if k not in (EMBED, LM_HEAD) and not any(_kept(n, (k,)) for n in names):
            raise FieldError("keep_high_precision", f"entry {k!r} matches no module")
    head = None
    if LM_HEAD not in keep:
        out = getattr(model, "output", None)
        if out is None:   # tied: the head gets its own quantized copy; the embedding stays
            emb = model.tok_embeddings.weight
            out = nn.Linear(emb.shape[1], emb.shape[0], bias=False)
            out.weight = emb
        head = out
    all_q = dict(linears, **({"output": head} if head is not None else {}))
    # W4A8: the int4 linears take the interleaved group-minimum format of the W4A8 kernel
    # (round-to-nearest: a Q4_1 GGUF's weights come back exactly); the head stays int8 W8A8.
    # int4 weight-only on the CPU at group 32: the same format, float activations
    # (kiln::linear_int4_rows16, 1.4-2.9x the [N, K/2] layout's decoder on SmolLM2's shapes).
    layer_scheme = "int4_a8" if weights == "int4" and activations == "int8" else weights
    gs = (formats.INT4_A8_GROUP if layer_scheme == "int4_a8" else
          _resolve_group_size(group_size, all_q) if weights == "int4" else None)
    # Decided per linear, on the weight as it is quantized (after any AWQ scale): one that
    # does not fit (rows not a multiple of 16, |w| beyond float16) keeps the [N, K/2] layout.
    rows16 = (layer_scheme == "int4" and device == "cpu" and gs == formats.INT4_A8_GROUP)
    if rows16:
        layer_scheme = "int4_a8"
    # what calibration inputs are for: AWQ scales (int4 weight-only), SmoothQuant (W8A8)
    calibrated = ("awq" if weights == "int4" and activations == "float" else
                  "smoothquant" if layer_scheme == "int8" and activations == "int8" else None)

    acts: dict[str, torch.Tensor] = {}
    method = "none" if weights == "fp32" else "rtn"   # fp32: the linears run the plugin's GEMV
    if calibration is not None and calibrated:
        acts = (dict(calibration) if isinstance(calibration, Mapping)
                else collect_inputs(model, linears, calibration))
        method = calibrated
    report = {"weights": weights, "scheme": layer_scheme, "group_size": gs, "method": method,
              "activations": ("float" if activations == "float" else
                              "int8-per-group-32-dynamic" if layer_scheme == "int4_a8" else
                              "int8-per-token-dynamic"),
              "kept": sorted(set(keep)), "quantized": [], "awq_alpha": {},
              "embedding": ("float" if EMBED in keep else
                            weights if weights in ("bf16", "fp32") else "int8-per-row"),
              "bytes_before": 0, "bytes_after": 0}
    if weights == "fp8":   # weights stored E4M3; this CPU kernel upcasts them (no FP8 MMA)
        report["fp8_compute"] = "upcast-fp32"
    if weights == "bf16":  # stored bf16, multiplied in float32 (no bf16 FMA on AVX2)
        report["bf16_compute"] = "upcast-fp32"
    qemb = None
    if EMBED not in keep:
        emb = model.tok_embeddings
        qemb = QuantEmbedding.from_embedding(emb, weights if weights in ("bf16", "fp32")
                                             else "int8")
        report["bytes_before"] += emb.weight.numel() * emb.weight.element_size()
        report["bytes_after"] += sum(b.numel() * b.element_size() for b in qemb.buffers())
    if calibration is not None and not calibrated:
        report["calibration"] = ("not used: AWQ scale search applies to int4 weight-only, "
                                 "SmoothQuant to int8 weights with int8 activations")
    rows16_used = False
    for name, lin in all_q.items():
        scale, alpha = None, None
        if name in acts and activations == "int8":
            scale, alpha = smooth_search(lin.weight, acts[name])
            report.setdefault("smooth_alpha", {})[name] = alpha
        elif name in acts:
            scale, alpha = awq_search(lin.weight, acts[name], weights, gs)
            report["awq_alpha"][name] = alpha
        if name == "output" and qemb is not None and scale is None \
                and lin.weight is model.tok_embeddings.weight:
            # Tied: the head reads the embedding's table (int8 whatever the plan's scheme:
            # an int4 head costs SmolLM2 +31% perplexity, int8 rows ~0.2%; bf16 at bf16).
            # With int8 activations it runs W8A8 unsmoothed (a shared table cannot take
            # SmoothQuant's scales): SmolLM2 +1.90% perplexity, against +0.80% with a
            # weight-only head, which made the batch-32 step 1.4x slower.
            q = QuantLinear(formats.QuantizedWeight(qemb.scheme, qemb.qweight, qemb.scales,
                                                    None, None, tuple(lin.weight.shape)),
                            activations=activations)
            report["lm_head"] = f"{qemb.scheme} (the tied embedding's table)"
        else:
            scheme = layer_scheme
            if rows16 and not formats.fits_int4_a8(
                    lin.weight.detach().float() / (1 if scale is None else scale[None, :])):
                scheme = "int4"
                report.setdefault("int4_layout_kept", []).append(name)
            rows16_used = rows16_used or scheme == "int4_a8"
            q = QuantLinear.from_linear(lin, scheme, gs, scale, activations)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, q)
        report["quantized"].append(name)
        report["bytes_before"] += lin.weight.numel() * lin.weight.element_size()
        shared = qemb is not None and q.qweight is qemb.qweight
        report["bytes_after"] += 0 if shared else sum(b.numel() * b.element_size()
                                                      for b in q.buffers())
    if qemb is not None:
        model.tok_embeddings = qemb
        report["quantized"].append("tok_embeddings")
    if rows16 and not rows16_used:
        report["scheme"] = "int4"   # not one linear fit the interleaved format
    return report

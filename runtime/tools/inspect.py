"""`kiln inspect`: a plan's manifest for a person."""
from __future__ import annotations

from pathlib import Path

from kiln.contracts.manifest import PlanManifest, QuantizationRecord
from kiln.plugins.paged_kv import kv_format


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def kv_bytes_per_token(manifest: PlanManifest) -> int:
    shape = manifest.model.shape
    return kv_format.bytes_per_token(manifest.kv_cache.dtype, shape.num_layers,
                                     shape.num_kv_heads, shape.head_dim)


def describe(m: PlanManifest, path: Path | str = "") -> str:
    cfg, lim, kv, tgt = m.model.shape, m.limits, m.kv_cache, m.target
    prec, tools = m.precision, m.toolchain
    per_tok = kv_bytes_per_token(m)
    if kv.budget_bytes:
        budget = kv.budget_bytes
        tokens = budget // per_tok
        kv_line = (f"{human_bytes(budget)} = {tokens} tokens "
                   f"({tokens // kv.tokens_per_block} blocks of {kv.tokens_per_block}), "
                   f"{tokens // lim.max_seq_len} full-length sequences")
    else:
        kv_line = f"{kv.budget_fraction:.0%} of free memory at load"
    target = tgt.device + (f" ({tgt.arch}, {tgt.isa})" if not tgt.is_gpu
                           else f" ({tgt.compute_capability})")
    rows = [
        ("plan", f"{m.name}  {path}"),
        ("model", f"{m.model.family}  {m.model.source}"),
        ("parameters", f"{m.model.num_parameters / 1e6:.1f}M  (layers {cfg.num_layers}, "
                       f"hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
                       f"{cfg.num_kv_heads} kv, vocab {cfg.vocab_size})"),
        ("precision", f"weights {prec.weights}, kv cache {prec.kv_cache}, "
                      f"activations {prec.activations}" + _scheme(prec.quantization)),
        ("target", f"{target}, backend {m.engine.backend}"),
        *([("cpu features", " ".join(tgt.cpu_features))] if tgt.cpu_features else []),
        *[("kernel", f"{lib}: {code_path}") for lib, code_path in
          m.engine.kernel_paths.items()],
        ("limits", f"batch {lim.max_batch_size}, seq {lim.max_seq_len}, input "
                   f"{lim.max_input_len}, tokens/step {lim.max_num_tokens}"),
        ("kv cache", f"{kv_line}; {human_bytes(per_tok)}/token"),
        ("scheduler", ", ".join(f"{k}={v}" for k, v in sorted(m.scheduler.to_json().items()))),
        *([("speculative", ", ".join(
            f"{k}={v}" for k, v in m.speculative.to_json().items()
            if k != "draft" and not (k.startswith("ngram_") and m.speculative.method != "ngram")))]
          if m.speculative else []),
        *([("draft plan", f"{d.name}  {d.path}  fingerprint {d.fingerprint}")]
          if m.speculative and (d := m.speculative.draft) else []),
        *([("lora", f"max_rank {lo.max_rank}, targets {', '.join(lo.target_modules)}, "
                    f"{lo.max_adapters_per_batch} adapters per step, {lo.max_cpu_adapters} "
                    f"loaded at most, {lo.dtype} A and B")] if (lo := m.lora) else []),
        ("size", f"{human_bytes(m.total_bytes)} in {len(m.files)} files: " + ", ".join(
            f"{k} {human_bytes(v.size)}" for k, v in m.files.items())),
        ("fingerprint", m.fingerprint),
        ("toolchain", f"kiln {tools.kiln}, torch {tools.torch}, python {tools.python}"),
        ("built", m.created_at or "-"),
    ]
    acc = m.accuracy
    if acc:
        rows.append(("accuracy", f"ppl {acc.ppl:.3f} vs {acc.ref_ppl:.3f} unquantized "
                                 f"({acc.ppl_increase:+.2%}, limit {acc.max_ppl_increase:.2%}), "
                                 f"top-1 agreement {acc.top1_agreement:.2%} on "
                                 f"{acc.tokens} tokens"))
    elif m.check:
        rows.append(("check", f"compiled vs eager max logit diff {m.check.max_logit_diff:.2e}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _scheme(q: QuantizationRecord) -> str:
    """The quantizer's format, group and method, where they say more than the weights dtype
    (int4_a8: the integer kernels' interleaved format; an int4 group size; awq / smoothquant)."""
    parts = [q.scheme] if q.scheme not in (None, q.weights) else []
    parts += [f"group {q.group_size}"] if q.group_size else []
    parts += [q.method] if q.method not in (None, "rtn", "none") else []
    kept = q.int4_layout_kept or ()
    parts += [f"{len(kept)} linear(s) in the int4 [N, K/2] layout"] if kept else []
    return f" ({', '.join(parts)})" if parts else ""

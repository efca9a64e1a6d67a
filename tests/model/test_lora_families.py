"""Multi-LoRA on every family the builder reads: a tiny random model of each made with
transformers' own classes, a LoRA adapter made on it with `peft` (random A, non-zero B), a
plan built with `lora` from its HF directory (AOTInductor for gemma2, whose layers are
Gemma's own; the exported program for the others, whose step code is Llama's, compiled in
test_lora_peft.py). The plan's greedy output equals transformers + peft's with the adapter,
and transformers' without it (the base). Llama itself is test_lora_peft.py.

    qwen3, mistral      the shared decoder layer (TransformerBlock)
    gemma2, gemma3      Gemma's own layers (GemmaBlock, GeGLU), sliding and global
    phi3                PEFT's adapter on the fused qkv_proj / gate_up_proj, mapped at load
                        onto the plan's q/k/v and gate/up
    mixtral, qwen3_moe  attention only: expert MLPs take no LoRA terms (refused at build)
"""
from __future__ import annotations

import pytest
import yaml

from kiln.builder.build import BuildError, build
from kiln.builder.progress import Progress
from kiln.runtime.engine import Engine
from kiln.runtime.plan import load_plan
from tests.lora_helpers import randomize_peft
from tests.model.test_gemma_plans import _gemma
from tests.model.test_lora_peft import _greedy, _reference
from tests.model.test_moe_plans import moe_model
from tests.model.test_sliding_window_plans import _tiny
from tests.model.test_sources import _hf_model, _write_tokenizer

pytestmark = pytest.mark.model
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# the second prompt and its answer cross the 16-token sliding window of mistral and gemma
PROMPTS = [[5, 77, 200, 31, 9], [300, 12] * 9 + [7]]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
PHI3_FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]   # Phi-3's own linears


def _mistral():
    return _tiny(transformers.MistralConfig, transformers.MistralForCausalLM, seed=5,
                 sliding_window=16, tie_word_embeddings=False)


# family -> (the tiny transformers model, peft's target_modules, the plan's lora targets)
FAMILIES = {
    "qwen3": (lambda: _hf_model("qwen3", dict(tie_word_embeddings=False, head_dim=32), seed=3),
              ALL, ALL),
    "mistral": (_mistral, ALL, ALL),
    "gemma2": (lambda: _gemma("gemma2"), ALL, ALL),
    "gemma3": (lambda: _gemma("gemma3"), ALL, ALL),
    "phi3": (lambda: _hf_model("phi3", dict(tie_word_embeddings=False, pad_token_id=0), seed=5),
             PHI3_FUSED, ALL),
    "mixtral": (lambda: moe_model("mixtral", seed=5), ATTENTION, ATTENTION),
    "qwen3_moe": (lambda: moe_model("qwen3_moe", seed=5), ATTENTION, ATTENTION),
}


def _spec(name: str, source, targets, backend: str = "eager") -> dict:
    return {"name": name, "model": {"source": str(source)},
            "target": {"device": "cpu", "backend": backend}, "precision": {"weights": "fp32"},
            "limits": {"max_batch_size": 4, "max_seq_len": 64, "max_num_tokens": 32},
            "kv_cache": {"tokens_per_block": 16, "memory": "4MiB"},
            "lora": {"max_rank": 8, "target_modules": list(targets),
                     "max_adapters_per_batch": 1, "max_cpu_adapters": 1}}


def _build(root, spec: dict):
    path = root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return build(path, root / "plans" / spec["name"], progress=Progress(enabled=False)).path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, engine of its lora plan with the adapter loaded as "a", the peft model)."""
    name = request.param
    make, peft_targets, plan_targets = FAMILIES[name]
    root = tmp_path_factory.mktemp(f"lora-{name}")
    base = make()
    base.save_pretrained(root / "hf")
    _write_tokenizer(root / "hf")
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=peft_targets))
    model = randomize_peft(model, seed=1, b_scale=0.3)
    model.save_pretrained(root / "adapter")
    backend = "aoti" if name == "gemma2" else "eager"
    plan = _build(root, _spec(f"{name}-lora", root / "hf", plan_targets, backend))
    with Engine.from_plan(load_plan(plan)) as eng:
        eng.adapters.load("a", root / "adapter")
        yield name, eng, model


@pytest.mark.parametrize("adapter", [None, "a"])
def test_greedy_equals_transformers_peft(family, adapter):
    _, eng, model = family
    got = [list(r.token_ids) for r in eng.generate(PROMPTS, _greedy(adapter))]
    with model.disable_adapter():
        base = [_reference(model, p) for p in PROMPTS]
    want = base if adapter is None else [_reference(model, p) for p in PROMPTS]
    assert got == want
    if adapter is not None:     # the adapter changes the output visibly
        assert want != base


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_expert_mlp_targets_are_refused_naming_them(name, tmp_path):
    base = FAMILIES[name][0]()
    base.save_pretrained(tmp_path / "hf")
    _write_tokenizer(tmp_path / "hf")
    with pytest.raises(BuildError, match=r"lora.target_modules \['down_proj'\]: this "
                       f"{name} model's MLPs are experts"):
        _build(tmp_path, _spec(f"{name}-mlp", tmp_path / "hf", ["q_proj", "down_proj"]))

"""Multi-LoRA on the real SmolLM2-135M-Instruct: an fp32 plan built with `lora` serves two
adapters made with `peft` on transformers' model of the same GGUF (rank 8 on the attention,
rank 16 on every linear). Each adapter's greedy output equals transformers + peft's on 8 chat
prompts (and visibly differs from the base model's); a mixed batch of all 8 prompts on the
base and both adapters gives every row what it gets alone.

The plan is small (max_batch 8, max_seq_len 256) and has no accuracy gate (fp32 weights and
KV cache); it is built once per fingerprint under the shared test-plans directory.
"""
from __future__ import annotations

import copy

import pytest
import torch
import yaml

from kiln.builder.build import build
from kiln.builder.progress import Progress
from kiln.runtime.engine import Engine
from kiln.runtime.plan import load_plan
from kiln.runtime.sampling import SamplingParams
from tests.conftest import SMOLLM2_GGUF_SOURCE, TEST_PLANS
from tests.lora_helpers import randomize_peft

pytestmark = pytest.mark.e2e
peft = pytest.importorskip("peft")

NEW_TOKENS = 16
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me three tips for better sleep.",
    "What is 12 times 7?",
    "Explain what a black hole is in one sentence.",
    "Name a famous painting by Leonardo da Vinci.",
    "Translate 'good morning' into Spanish.",
]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {   # name -> peft LoraConfig arguments
    "attn8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all16": dict(r=16, lora_alpha=16, target_modules=ALL),
}
SPEC = {"name": "smollm2-135m-lora-fp32", "model": {"source": SMOLLM2_GGUF_SOURCE},
        "target": {"device": "cpu", "backend": "aoti"}, "precision": {"weights": "fp32"},
        "limits": {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 128},
        "kv_cache": {"tokens_per_block": 16, "memory": "64MiB"},
        "lora": {"max_rank": 16, "target_modules": ALL, "max_adapters_per_batch": 3,
                 "max_cpu_adapters": 4}}


@pytest.fixture(scope="module")
def lora_plan(smollm2_gguf, tmp_path_factory):
    """The fp32 SmolLM2 plan with a lora section (every target, rank <= 16, 3 slots)."""
    spec = tmp_path_factory.mktemp("lora-smollm2") / f"{SPEC['name']}.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    return build(spec, TEST_PLANS / SPEC["name"], progress=Progress(enabled=False)).path


@pytest.fixture(scope="module")
def references(smollm2_hf, tmp_path_factory):
    """({name: adapter dir}, {name or None: the transformers model}): peft adapters of random
    A and non-zero B on copies of transformers' SmolLM2, saved with save_pretrained."""
    _, base = smollm2_hf
    root = tmp_path_factory.mktemp("smollm2-adapters")
    dirs, models = {}, {None: base}
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        model = peft.get_peft_model(copy.deepcopy(base),
                                    peft.LoraConfig(lora_dropout=0.0, **cfg))
        randomize_peft(model, seed=i + 1, b_scale=0.05)
        model.save_pretrained(root / name)
        dirs[name], models[name] = root / name, model
    return dirs, models


@pytest.fixture(scope="module")
def engine(lora_plan, references):
    with Engine.from_plan(load_plan(lora_plan)) as eng:
        for name, d in references[0].items():
            eng.adapters.load(name, d)
        yield eng


@pytest.fixture(scope="module")
def prompts(smollm2_hf) -> list[list[int]]:
    tok, _ = smollm2_hf
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in QUESTIONS]
    return [tok(c).input_ids for c in chats]


def _greedy(adapter=None) -> SamplingParams:
    # min_tokens mirrors transformers' min_new_tokens: eos is masked until all are out.
    return SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0,
                          adapter=adapter)


def _reference(model, prompt) -> list[int]:
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(references, prompts) -> dict:
    """{adapter or None: transformers (+ peft) greedy tokens of each prompt}."""
    return {name: [_reference(m, p) for p in prompts] for name, m in references[1].items()}


def test_adapters_change_the_output_visibly(expected):
    # Random adapters move the logits by several units, yet a confident reply can survive
    # 16 tokens unchanged: most prompts must change, not every one.
    for name in ADAPTERS:
        changed = [got != base for got, base in zip(expected[name], expected[None])]
        assert sum(changed) >= 6, (name, changed)


def _divergence(model, prompt, want, got) -> str:
    """Where `got` leaves transformers' greedy path, and by how much transformers' top token
    led there (a margin near 0 is a near-tie that fp32 rounding may flip)."""
    j = next(k for k, (a, b) in enumerate(zip(want, got)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:j]])).logits[0, -1]
    return (f"token {j}: transformers {want[j]} ({logits[want[j]]:.5f}), kiln {got[j]} "
            f"({logits[got[j]]:.5f})")


@pytest.mark.parametrize("adapter", [None, *ADAPTERS])
def test_each_adapter_greedy_equals_transformers_peft(engine, prompts, references, expected,
                                                      adapter):
    got = engine.generate(prompts, _greedy(adapter))
    for i, res in enumerate(got):
        assert res.prompt_token_ids == prompts[i]
        want, tokens = expected[adapter][i], list(res.token_ids)
        assert tokens == want, (adapter, QUESTIONS[i],
                                _divergence(references[1][adapter], prompts[i], want, tokens))


def test_mixed_batch_gives_each_row_what_it_gets_alone(engine, prompts):
    names = [None, *ADAPTERS]
    keys = [(a, i) for i in range(len(prompts)) for a in names]
    alone = {(a, i): list(engine.generate([prompts[i]], _greedy(a))[0].token_ids)
             for a, i in keys}
    got = engine.generate([prompts[i] for _, i in keys], [_greedy(a) for a, _ in keys])
    assert {k: list(r.token_ids) for k, r in zip(keys, got)} == alone

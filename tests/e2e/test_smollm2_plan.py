"""The default SmolLM2 plan (AOTInductor, CPU) against transformers loading the same GGUF."""
from __future__ import annotations

import pytest
import torch

from kiln.runtime.engine import Engine
from kiln.runtime.executor import ModelInput
from kiln.runtime.sampling import SamplingParams

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def engine(smollm2_plan):
    eng = Engine.from_plan(smollm2_plan, kv_budget_bytes=256 << 20)
    yield eng
    eng.shutdown()


def test_greedy_matches_transformers(engine, smollm2_hf):
    tok, model = smollm2_hf
    # min_tokens mirrors HF's min_new_tokens: eos is masked until 32 tokens are out.
    params = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0)
    results = engine.generate(PROMPTS, params)
    for prompt, res in zip(PROMPTS, results):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert res.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert res.token_ids == ref[0, ids.shape[1]:].tolist(), prompt


def test_last_position_logits_match(engine, smollm2_hf):
    tok, model = smollm2_hf
    ex = engine.executor
    prompts = [tok(p).input_ids for p in PROMPTS]
    # Blocks far from anything the engine handed out (the engine is idle between tests).
    n = ex.layout.num_blocks
    tables, nxt = [], n - 1
    for p in prompts:
        need = -(-len(p) // ex.layout.tokens_per_block)
        tables.append(list(range(nxt, nxt - need, -1)))
        nxt -= need
    got = ex.execute(ModelInput.build(prompts, [0] * len(prompts), tables,
                                      ex.layout.tokens_per_block))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0, -1]
        assert (got[i] - ref).abs().max().item() <= 1e-3


def test_chat_reply_is_sensible(engine):
    res = engine.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                          SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "Paris" in res.text

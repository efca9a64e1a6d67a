"""LoRA adapters made with `peft` on a tiny random Llama made with transformers' classes,
served by a kiln plan built with `lora`: each adapter's greedy output equals transformers +
peft's on the same weights; a mixed batch (more adapters than the step's slots, and base
requests) gives every row what it gets alone; bad adapters and unknown names are refused
while the engine keeps serving."""
from __future__ import annotations

import pytest
import torch
import yaml

from kiln.builder.build import build
from kiln.builder.progress import Progress
from kiln.runtime.engine import Engine
from kiln.runtime.lora import UnknownAdapterError
from kiln.runtime.lora_peft import AdapterError
from kiln.runtime.plan import load_plan
from kiln.runtime.sampling import SamplingParams
from tests.conftest import TEST_PLANS
from tests.lora_helpers import randomize_peft, write_peft
from tests.model.test_sources import _hf_model, _write_tokenizer

pytestmark = pytest.mark.model
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 77, 200, 31, 9], list(range(40, 51)), [300, 12] * 9 + [7], [3, 4]]
NEW_TOKENS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {   # name -> peft LoraConfig arguments
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "mlp16": dict(r=16, lora_alpha=8, use_rslora=True,
                  target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "all4": dict(r=4, lora_alpha=4, target_modules=ALL),
}


def _peft_model(base_dir, name: str, seed: int):
    """transformers' model of base_dir with a peft adapter of random A and non-zero B."""
    base = transformers.LlamaForCausalLM.from_pretrained(base_dir).eval()
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **ADAPTERS[name]))
    return randomize_peft(model, seed, b_scale=0.3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(plan dir, base model dir, {name: adapter dir}, {name or None: the transformers
    model})."""
    root = tmp_path_factory.mktemp("lora-peft")
    base_dir = root / "tiny-llama"
    base = _hf_model("llama", dict(tie_word_embeddings=False))
    base.save_pretrained(base_dir)
    _write_tokenizer(base_dir)
    refs, dirs = {None: base}, {}
    for i, name in enumerate(ADAPTERS):
        refs[name] = _peft_model(base_dir, name, seed=i + 1)
        refs[name].save_pretrained(root / name)
        dirs[name] = root / name
    return _build(root, base_dir, "float32"), base_dir, dirs, refs


def _build(root, base_dir, dtype: str, slots: int = 2):
    """The tiny model's fp32 plan with a lora section of `slots` adapters a step whose A and
    B are `dtype`."""
    name = "tiny-lora-peft" + ("" if dtype == "float32" else f"-{dtype}")
    spec = {"name": name, "model": {"source": str(base_dir)},
            "target": {"device": "cpu"}, "precision": {"weights": "fp32"},
            "limits": {"max_batch_size": max(8, 2 * slots), "max_seq_len": 128,
                       "max_num_tokens": 64},
            "kv_cache": {"tokens_per_block": 16, "memory": "8MiB"},
            "lora": {"max_rank": 16, "target_modules": ALL, "max_adapters_per_batch": slots,
                     "max_cpu_adapters": max(4, slots), "dtype": dtype}}
    (root / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    return build(root / f"{name}.yaml", TEST_PLANS / name, progress=Progress(enabled=False)).path


@pytest.fixture(scope="module")
def engine(setup):
    plan, _, dirs, _ = setup
    with Engine.from_plan(load_plan(plan)) as eng:
        for name, d in dirs.items():
            eng.adapters.load(name, d)
        yield eng


def _greedy(adapter=None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                          adapter=adapter)


def _reference(model, prompt) -> list[int]:
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("adapter", [None, *ADAPTERS])
def test_each_adapter_greedy_equals_transformers_peft(setup, engine, adapter):
    refs = setup[3]
    got = engine.generate(PROMPTS, _greedy(adapter))
    want = [_reference(refs[adapter], p) for p in PROMPTS]
    assert [list(r.token_ids) for r in got] == want
    if adapter is not None:     # the adapter changes the output visibly
        assert want != [_reference(refs[None], p) for p in PROMPTS]


def test_mixed_batch_gives_each_row_what_it_gets_alone(engine):
    names = [None, *ADAPTERS]            # three adapters: more than the step's two slots
    alone = {(a, i): list(engine.generate([p], _greedy(a))[0].token_ids)
             for a in names for i, p in enumerate(PROMPTS)}
    keys = [(a, i) for i in range(len(PROMPTS)) for a in names]
    got = engine.generate([PROMPTS[i] for _, i in keys], [_greedy(a) for a, _ in keys])
    assert {k: list(r.token_ids) for k, r in zip(keys, got)} == alone


def test_unknown_adapter_is_an_error_never_the_base_model(engine):
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'nope'"):
        engine.submit(PROMPTS[0], _greedy("nope"))


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(setup, engine, tmp_path):
    base_dir = setup[1]
    big = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(base_dir),
                              peft.LoraConfig(r=32, target_modules=["q_proj"]))
    big.save_pretrained(tmp_path / "big")
    with pytest.raises(AdapterError, match="rank 32 exceeds the plan's lora.max_rank \\(16\\)"):
        engine.adapters.load("big", tmp_path / "big")
    assert "big" not in engine.adapters.names()
    res = engine.generate([PROMPTS[0]], _greedy("qv8"))[0]
    assert len(res.token_ids) == NEW_TOKENS


@pytest.fixture(scope="module")
def bf16_plan(setup, tmp_path_factory):
    """The same model's plan with 8 bfloat16 adapter slots a step."""
    return _build(tmp_path_factory.mktemp("lora-bf16"), setup[1], "bfloat16", slots=8)


def test_bfloat16_adapters_equal_peft_on_the_rounded_weights(setup, bf16_plan):
    """A plan with lora.dtype bfloat16 holds A and B in bfloat16 and computes in float32: each
    adapter's greedy output equals transformers + peft's with its LoRA weights rounded to
    bfloat16 (in a batch that mixes them)."""
    _, base_dir, dirs, _ = setup
    with Engine.from_plan(load_plan(bf16_plan)) as eng:
        assert {t.dtype for t in (*eng.adapters.buffers.a, *eng.adapters.buffers.b)} == \
            {torch.bfloat16}
        for name, d in dirs.items():
            eng.adapters.load(name, d)
        keys = [(a, i) for i in range(len(PROMPTS)) for a in ADAPTERS]
        got = eng.generate([PROMPTS[i] for _, i in keys], [_greedy(a) for a, _ in keys])
    for i, name in enumerate(ADAPTERS):
        model = _peft_model(base_dir, name, seed=i + 1)      # the setup's adapter, afresh
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(p.to(torch.bfloat16).float())
        want = [_reference(model, p) for p in PROMPTS]
        assert [list(r.token_ids) for (a, _), r in zip(keys, got) if a == name] == want, name


def test_a_batch_of_eight_adapters_and_base_rows_gives_each_row_what_it_gets_alone(
        setup, bf16_plan, tmp_path):
    """Eight adapters in one step (the plan's slots; ranks 4-16, different targets) beside base
    rows: every row gets exactly the tokens it gets alone."""
    plan = load_plan(bf16_plan)
    dirs = dict(setup[2])
    for i in range(8 - len(dirs)):
        mods = ALL[i % 3::2] or ALL
        write_peft(tmp_path / f"extra{i}", plan.manifest.lora, plan.shape.num_layers,
                   r=(4, 8, 16)[i % 3], modules=mods, seed=10 + i, alpha=8.0)
        dirs[f"extra{i}"] = tmp_path / f"extra{i}"
    names = [None, *dirs]
    with Engine.from_plan(plan) as eng:
        for name, d in dirs.items():
            eng.adapters.load(name, d)
        keys = [(a, i) for i in range(2) for a in names]
        alone = {k: list(eng.generate([PROMPTS[k[1]]], _greedy(k[0]))[0].token_ids)
                 for k in keys}
        per_step, token_slots = [], eng.adapters.token_slots

        def counted(adapters, counts):        # the adapters of each step
            per_step.append(len({a for a in adapters if a is not None}))
            return token_slots(adapters, counts)
        eng.adapters.token_slots = counted
        got = eng.generate([PROMPTS[i] for _, i in keys], [_greedy(a) for a, _ in keys])
    assert max(per_step) == 8
    assert {k: list(r.token_ids) for k, r in zip(keys, got)} == alone
    assert len({tuple(v) for k, v in alone.items() if k[1] == 0}) >= 6   # they differ

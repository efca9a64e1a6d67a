"""Spec validation: every error names the YAML path, the bad value and what is allowed."""
from pathlib import Path

import pytest

from kiln.builder.arch.config import UnsupportedConfig
from kiln.builder.spec import SpecError, eval_tokens_for, load_spec, parse_memory, parse_spec
from tests.helpers import TINY_SPEC as BASE, spec_problems as problems

pytestmark = pytest.mark.unit


def test_minimal_spec_fills_defaults():
    spec = parse_spec(BASE)
    assert spec.target.device == "cpu" and spec.target.backend == "aoti"
    assert spec.precision.weights == "fp32" and spec.kv_dtype == "fp32"
    assert spec.limits.input_len == spec.limits.max_seq_len - 1


@pytest.mark.parametrize("precision,kv,limit", [
    ("{weights: fp32}", "fp32", None),                       # no gate unless asked
    ("{weights: fp32, kv_cache: int8}", "int8", 0.02),       # the KV cache's share alone
    ("{weights: fp32, kv_cache: fp8}", "fp8", 0.04),
    ("{weights: int8}", "bf16", 0.03),
    ("{weights: int8, kv_cache: int8}", "int8", 0.05),       # weights' share + KV's
    ("{weights: fp8, kv_cache: fp8}", "fp8", 0.09),
    ("{weights: bf16}", "bf16", 0.01),
])
def test_default_gate_adds_the_kv_cache_share(precision, kv, limit):
    spec = parse_spec(BASE + f"precision: {precision}\n")
    assert spec.kv_dtype == kv and spec.max_ppl_increase == limit
    spec = parse_spec(BASE + f"precision: {precision}\naccuracy: {{max_ppl_increase: 0.5}}\n")
    assert spec.max_ppl_increase == 0.5


@pytest.mark.parametrize("params,tokens", [
    (135_000_000, 20480), (1_240_000_000, 20480), (1_500_000_000, 20480),
    (3_210_000_000, 9472), (8_030_000_000, 3584), (70_600_000_000, 2048)])
def test_the_gates_tokens_shrink_with_the_model_unless_the_spec_sets_them(params, tokens):
    spec = parse_spec(BASE)
    assert spec.accuracy.eval_tokens is None and "eval_tokens" not in spec.canonical()["accuracy"]
    assert eval_tokens_for(spec.accuracy, params) == tokens
    spec = parse_spec(BASE + "accuracy: {eval_tokens: 1024}\n")
    assert eval_tokens_for(spec.accuracy, params) == 1024
    assert spec.canonical()["accuracy"]["eval_tokens"] == 1024


def test_unknown_key_names_its_path():
    probs, msg = problems(BASE + "limits: {max_batch: 4}\n")
    assert "limits.max_batch" in probs
    assert "unknown key" in probs["limits.max_batch"]


def test_unknown_top_level_key():
    probs, _ = problems(BASE + "colour: blue\n")
    assert "colour" in probs


def test_wrong_type_names_value():
    probs, _ = problems(BASE + "limits: {max_batch_size: lots}\n")
    assert "'lots'" in probs["limits.max_batch_size"]


def test_limits_out_of_range():
    probs, _ = problems(BASE + "limits: {max_batch_size: 0}\n")
    assert "greater than or equal to 1" in probs["limits.max_batch_size"]


def test_input_len_beyond_seq_len():
    probs, msg = problems(BASE + "limits: {max_seq_len: 128, max_input_len: 200}\n")
    assert "max_input_len (200) must be below max_seq_len (128)" in msg


def test_token_budget_below_batch():
    _, msg = problems(BASE + "limits: {max_batch_size: 64, max_num_tokens: 16}\n")
    assert "max_num_tokens (16) must be at least max_batch_size (64)" in msg


def test_missing_source():
    probs, _ = problems("name: t\nmodel: {}\n")
    assert probs["model.source"] == "required key is missing"


def test_unknown_precision_lists_allowed():
    probs, _ = problems(BASE + "precision: {weights: int3}\n")
    assert "'int3'" in probs["precision.weights"] and "int8" in probs["precision.weights"]


def test_unknown_device():
    probs, _ = problems(BASE + "target: {device: tpu}\n")
    assert "unknown device 'tpu'" in probs["target.device"]


def test_gpu_names_resolve_to_compute_capability():
    spec = parse_spec(BASE + "target: {device: H200}\n")
    assert spec.target.compute_capability == "sm_90"


def test_fp8_activations_need_fp8_hardware():
    probs, _ = problems(BASE + "target: {device: a100}\nprecision: {activations: fp8}\n")
    assert "sm_89" in probs["precision.activations"]


def test_group_size_only_for_int4():
    probs, _ = problems(BASE + "precision: {weights: fp32, group_size: 64}\n")
    assert "int4" in probs["precision.group_size"]


def test_bad_memory_budget():
    probs, _ = problems(BASE + "kv_cache: {memory: lots}\n")
    assert "not a memory size" in probs["kv_cache.memory"]
    assert parse_memory("512MiB") == ("bytes", 512 << 20)
    assert parse_memory(0.5) == ("fraction", 0.5)


def test_random_needs_arch():
    _, msg = problems("name: t\nmodel: {source: random}\n")
    assert "needs `arch`" in msg


def test_not_yaml_mapping():
    probs, _ = problems("- a\n- b\n")
    assert "(top level)" in probs


def test_relative_source_resolved_against_spec_dir(tmp_path):
    (tmp_path / "s.yaml").write_text("name: t\nmodel: {source: ckpt/model}\n")
    spec = load_spec(tmp_path / "s.yaml")
    assert spec.model.source == str(tmp_path / "ckpt" / "model")


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "nope.yaml")


def test_canonical_digest_changes_with_any_field():
    a = parse_spec(BASE)
    b = parse_spec(BASE + "limits: {max_seq_len: 1024}\n")
    c = parse_spec(BASE.replace("name: t", "name: u"))
    assert len({a.digest(), b.digest(), c.digest()}) == 3
    assert a.digest() == parse_spec(BASE).digest()


def test_target_isa_levels():
    assert parse_spec(BASE).target.isa == "auto"
    assert parse_spec(BASE + "target: {device: cpu, isa: avx2}\n").target.isa == "avx2"
    probs, msg = problems(BASE + "target: {device: cpu, isa: avx3}\n")
    assert "target.isa" in probs and "avx3" in msg and "avx512_vnni" in msg and "none" in msg
    probs, msg = problems(BASE + "target: {device: h100, isa: avx2}\n")
    assert "target.isa" in probs and "cpu targets" in msg


MISTRAL = {"model_type": "mistral", "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "max_position_embeddings": 4096, "sliding_window": 512}


@pytest.mark.parametrize("max_seq_len", [1024, 512, 256])
def test_mistral_runs_past_its_sliding_window(max_seq_len):
    """Paged attention honours the window: a context past Mistral's sliding_window builds,
    and every layer attends through the window."""
    from kiln.builder.arch.families import config_from_hf
    from kiln.builder.build import check_spec_against_model

    cfg = config_from_hf({**MISTRAL, "num_hidden_layers": 3})
    assert cfg.sliding_window == 512 and [cfg.window_for(i) for i in range(3)] == [512] * 3
    check_spec_against_model(parse_spec(BASE + f"limits: {{max_seq_len: {max_seq_len}}}\n"),
                             cfg)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_window_layers_as_transformers_decides(model_type):
    """No window without use_sliding_window; with it, the layers layer_types marks sliding,
    or without layer_types those from max_window_layers on (none: no window at all)."""
    from kiln.builder.arch.families import config_from_hf

    qwen = {**MISTRAL, "model_type": model_type, "sliding_window": 4096, "num_hidden_layers": 4}
    assert config_from_hf(qwen).sliding_window is None
    on = {**qwen, "use_sliding_window": True}
    assert config_from_hf(on).sliding_window is None              # max_window_layers 28 > 4
    cfg = config_from_hf({**on, "max_window_layers": 1})
    assert [cfg.window_for(i) for i in range(4)] == [0, 4096, 4096, 4096]
    types = ["sliding_attention", "full_attention"] * 2
    cfg = config_from_hf({**on, "max_window_layers": 1, "layer_types": types})
    assert [cfg.window_for(i) for i in range(4)] == [4096, 0, 4096, 0]
    with pytest.raises(UnsupportedConfig, match="layer_types"):
        config_from_hf({**on, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(UnsupportedConfig, match="4 entries"):
        config_from_hf({**on, "layer_types": ["full_attention"]})
    assert config_from_hf({**MISTRAL, "sliding_window": None}).sliding_window is None


def test_gguf_sliding_window_on_every_layer_or_refused():
    """llama.cpp's {arch}.attention.sliding_window: Mistral/Llama GGUFs window every layer;
    a Qwen GGUF cannot say which layers, so it is refused naming the key."""
    from kiln.builder.arch.llama import gguf_window

    assert gguf_window({"general.architecture": "llama"}) == {}
    assert gguf_window({"general.architecture": "mistral",
                        "mistral.attention.sliding_window": 4096}) == {"sliding_window": 4096}
    for arch in ("qwen2", "qwen3"):
        with pytest.raises(UnsupportedConfig, match=f"{arch}.attention.sliding_window"):
            gguf_window({"general.architecture": arch, f"{arch}.attention.sliding_window": 64})


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "model_specs")
                                        .glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_spec_is_valid(path):
    """What `model_specs/` ships parses (no build: the e2e tier and benchmarks build them)."""
    spec = load_spec(path)
    assert spec.name == path.stem

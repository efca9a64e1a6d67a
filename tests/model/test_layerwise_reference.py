"""The accuracy reference run one decoder layer at a time (builder/layerwise_reference.py)
gives the whole-model eager reference's numbers, for every family and for each way a source
gives its tensors (random: one stream; HF safetensors: only the named tensors)."""
import pytest
import torch
import transformers

from kiln.builder.accuracy_reference import eager_layout, reference
from kiln.builder.layerwise_reference import by_group, evaluate_layerwise, groups, supported
from kiln.builder.quantize import quantize_model
from kiln.builder.sources import load_model, open_checkpoint
from kiln.builder.sources.tokenizer_build import byte_level
from kiln.builder.spec import ModelSpec, RandomArch
from kiln.runtime import accuracy_gate as racc

pytestmark = pytest.mark.model

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {   # model_type, arch.config, arch fields
    "llama": ("llama", {}, {}),
    "llama-tied": ("llama", {}, dict(tie_word_embeddings=True)),
    "mistral-window": ("mistral", dict(sliding_window=8), {}),
    "qwen3": ("qwen3", dict(use_sliding_window=False), {}),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), {}),
    "gemma3": ("gemma3_text", dict(sliding_window=8), {}),
}
WINDOW = 64
IDS = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(0)).tolist()


def _whole(ckpt) -> racc.EvalResult:
    model = load_model(ckpt)
    return racc.evaluate(model, eager_layout(model, WINDOW), IDS, WINDOW)


def _same(a: racc.EvalResult, b: racc.EvalResult) -> None:
    assert a.count == b.count == len(IDS) - len(racc.windows(IDS, WINDOW))
    assert a.nll_sum == pytest.approx(b.nll_sum, rel=1e-5)
    assert a.top1 == b.top1


@pytest.mark.parametrize("case", list(FAMILIES))
def test_layerwise_equals_whole_model(case):
    mtype, extra, fields = FAMILIES[case]
    arch = RandomArch(**BASE, **fields, model_type=mtype, config=extra)
    ckpt = open_checkpoint(ModelSpec(source="random", arch=arch, seed=0))
    assert supported(ckpt.config)
    _same(evaluate_layerwise(ckpt, IDS, WINDOW), _whole(ckpt))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{k: v for k, v in BASE.items()},
                                   tie_word_embeddings=request.param)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    (d / "tokenizer.json").write_text(byte_level(BASE["vocab_size"], 1, 2))
    return open_checkpoint(ModelSpec(source=str(d)))


def test_hf_reads_one_group_at_a_time_and_equals_whole_model(hf_ckpt):
    with torch.device("meta"):
        from kiln.builder.arch.families import build_model
        gs = groups(build_model(hf_ckpt.config))
    got = [set(g) for g in by_group(hf_ckpt, gs)]
    assert got == gs                       # each group's tensors, no more
    assert all(len(g) <= 9 for g in gs)    # a layer (or embedding, norm + head): never all
    _same(evaluate_layerwise(hf_ckpt, IDS, WINDOW), _whole(hf_ckpt))


def test_gate_verdict_unchanged(hf_ckpt, tmp_path, monkeypatch):
    """A quantized model scored against either reference: the same verdict and increase."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    whole = _whole(hf_ckpt)
    layer, cached = reference(hf_ckpt, IDS, WINDOW, "t")      # no model: layer by layer
    assert not cached
    model = load_model(hf_ckpt)
    quantize_model(model, "int4", group_size=32)
    res = racc.evaluate(model, eager_layout(model, WINDOW), IDS, WINDOW)
    for limit in (0.0, 0.01, 1.0):
        a = racc.score(res, whole.ppl, whole.top1, limit)
        b = racc.score(res, layer.ppl, layer.top1, limit)
        assert a.passed == b.passed and a.top1_agreement == b.top1_agreement
        assert a.ppl_increase == pytest.approx(b.ppl_increase, abs=1e-6)

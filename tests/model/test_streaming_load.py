"""The streaming load (builder/streaming.py) packs the same weights, with the same record, as
loading the float32 model whole and quantizing it (quantize_model), at every precision."""
import pytest
import torch

from kiln.builder.quantize import quantize_model
from kiln.builder.sources import load_model
from kiln.builder.sources.random_source import open_random
from kiln.builder.spec import RandomArch
from kiln.builder.streaming import load_quantized

pytestmark = pytest.mark.model


def _ckpt(tied: bool, bias: bool = False):
    arch = RandomArch(vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=tied, attention_bias=bias)
    return open_random(arch, 3)


def _bf16_source(ckpt):
    """ckpt's tensors rounded to bf16, streamed as bf16 where the reader asks for the
    source's dtype (dtype None), as a bf16 safetensors checkpoint is."""
    full = ckpt._stream

    def stream(dtype):
        for n, t in full(torch.float32):
            t = t.to(torch.bfloat16)
            yield n, t if dtype is None else t.to(dtype)
    ckpt._stream = stream
    return ckpt


def test_the_stream_keeps_bf16_only_for_what_it_packs_at_once():
    from kiln.builder import streaming

    ckpt = _bf16_source(_ckpt(False))
    kept = []
    real = streaming._StreamQuantizer.keeps_source

    def spy(self, name):
        kept.append(name) if real(self, name) else None
        return real(self, name)
    streaming._StreamQuantizer.keeps_source = spy
    try:
        model, _ = load_quantized(ckpt, "int4", None, ("layers.1",), "int8", "cpu")
    finally:
        streaming._StreamQuantizer.keeps_source = real
    assert "tok_embeddings.weight" in kept and "output.weight" in kept
    assert "layers.0.attention.wqkv.weight" in kept
    assert not any(n.startswith("layers.1.") or "norm" in n for n in kept)
    floats = [t for t in model.state_dict().values() if t.is_floating_point()]
    assert floats and all(t.dtype != torch.bfloat16 for t in floats)


@pytest.mark.parametrize("weights,acts,keep,tied", [
    ("int4", "int8", ("lm_head",), True),       # W4A8, embedding packed, tied int8 head
    ("int4", "int8", (), False),                # untied head quantized on its own
    ("int8", "int8", (), True),
    ("int8", "float", ("embed", "lm_head"), False),
    ("int4", "float", ("embed",), True),        # kept embedding, quantized tied head
    ("int8", "float", ("lm_head",), True),      # packed embedding, kept tied head
    ("fp8", "float", ("layers.1",), False),
    ("bf16", "float", (), True),
    ("fp32", "float", (), False),
])
@pytest.mark.parametrize("source", ["float32", "bfloat16"])
def test_streamed_equals_whole_model_quantized(weights, acts, keep, tied, source):
    ckpt = _ckpt(tied, bias=weights == "int8")
    if source == "bfloat16":     # a bf16 checkpoint: the stream packs its weights unwidened
        ckpt = _bf16_source(ckpt)
    ref = load_model(ckpt)
    ref_record = quantize_model(ref, weights, keep_high_precision=keep, activations=acts)
    model, record = load_quantized(ckpt, weights, None, keep, acts, "cpu")
    assert record == ref_record
    a, b = ref.state_dict(), model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [type(m).__name__ for m in model.modules()] == \
        [type(m).__name__ for m in ref.modules()]


def test_streamed_load_still_names_a_missing_tensor():
    from kiln.builder.sources import CheckpointError

    ckpt = _ckpt(True)
    full = ckpt._stream
    ckpt._stream = lambda dtype: ((n, t) for n, t in full(dtype) if "w2" not in n)
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.0\.feed_forward\.w2"):
        load_quantized(ckpt, "int4", None, (), "int8", "cpu")


@pytest.mark.parametrize("scheme", ["int8", "bf16", "fp32"])
def test_embedding_by_rows_equals_the_whole_table(scheme):
    from kiln.builder.streaming import embedding_by_rows
    from kiln.plugins.quant.modules import QuantEmbedding

    w = torch.randn(100, 24) * torch.linspace(0.1, 3, 100)[:, None]
    whole = QuantEmbedding.from_embedding(torch.nn.Embedding.from_pretrained(w), scheme)
    rows = embedding_by_rows(w, scheme, rows=7)
    assert torch.equal(rows.qweight, whole.qweight)
    assert (rows.scales is None and whole.scales is None) or torch.equal(rows.scales,
                                                                         whole.scales)

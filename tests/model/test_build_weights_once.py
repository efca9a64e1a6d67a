"""A build holds a quantized model's weights once: the captured step reads them as
parameters (AOTInductor clones every buffer a graph reads), and after the compile the eager
model is pointed at the plan's mapped weights file, checked equal, for the check and gate."""
import gc
import weakref

import pytest
import torch

from kiln.builder import compile as kcompile
from kiln.builder.sources.random_source import open_random
from kiln.builder.spec import RandomArch
from kiln.builder.streaming import load_quantized

pytestmark = pytest.mark.model


def _model(tied: bool):
    arch = RandomArch(vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=tied)
    model, _ = load_quantized(open_random(arch, 5), "int4", None, (), "int8", "cpu")
    return model


def test_the_captured_step_reads_the_packed_weights_as_parameters():
    model = _model(tied=True)
    before = {n: t.data_ptr() for n, t in model.state_dict().items()}
    ep = kcompile.capture(model, max_num_tokens=16, max_batch_size=2, max_blocks=4,
                          tokens_per_block=16, kv_dtype="int8")
    sig = ep.graph_signature
    assert not set(sig.inputs_to_buffers.values()) - {"inv_freq"}   # nothing AOTI clones
    assert "layers.0.attention.wqkv.qweight" in sig.inputs_to_parameters.values()
    # the same tensors under the same names; the tied table is one parameter
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == before
    assert model.output.qweight is model.tok_embeddings.qweight
    assert not any(p.requires_grad for p in model.parameters())


def test_the_model_is_pointed_at_the_mapped_weights_once_they_match():
    model = _model(tied=False)
    kcompile.weights_as_parameters(model)
    copies = {n: t.clone() for n, t in model.state_dict().items()}
    freed = kcompile.bind_mapped_weights(model, copies)
    assert freed > 0
    for n, t in model.state_dict().items():
        assert t.data_ptr() == copies[n].data_ptr(), n
    # a file whose bytes differ from the model's is a kiln bug, named, not a silent rebind
    bad = {n: t.clone() for n, t in model.state_dict().items()}
    bad["layers.1.feed_forward.w2.scales"].add_(1)
    with pytest.raises(RuntimeError, match=r"disagrees with the model at "
                                           r"layers\.1\.feed_forward\.w2\.scales"):
        kcompile.bind_mapped_weights(model, bad)


def test_once_bound_nothing_but_the_mapped_file_holds_the_weights():
    """After the capture, the model's own weights die when it is pointed at the file: the
    tracer's memory of the export and the tied table's second name held them before."""
    model = _model(tied=True)
    ep = kcompile.capture(model, max_num_tokens=16, max_batch_size=2, max_blocks=4,
                          tokens_per_block=16, kv_dtype="int8")
    del ep
    gc.collect()
    owned = [weakref.ref(t) for t in model.state_dict().values()]
    mapped = {n: t.clone() for n, t in model.state_dict().items()
              if not n.startswith("tok_embeddings.")}      # the file names a tied table once
    kcompile.bind_mapped_weights(model, mapped)
    gc.collect()
    assert all(ref() is None for ref in owned)
    assert model.tok_embeddings.qweight is model.output.qweight
    assert model.output.qweight.data_ptr() == mapped["output.qweight"].data_ptr()

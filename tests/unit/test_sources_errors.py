"""Broken checkpoints give a CheckpointError that names the file and the problem."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kiln.builder.arch.llama import LlamaConfig, param_shapes
from kiln.builder.sources import Checkpoint, CheckpointError, load_model, open_checkpoint, \
    resolve_source
from kiln.builder.sources.tokenizer_build import byte_level
from kiln.builder.spec import ModelSpec

pytestmark = pytest.mark.unit

HF_CONFIG = {"model_type": "llama", "vocab_size": 260, "hidden_size": 16,
             "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1, "tie_word_embeddings": True, "bos_token_id": 1,
             "eos_token_id": 2}


def _hf_tensors() -> dict[str, torch.Tensor]:
    h, i, d, v = 16, 32, 8, 260
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (2 * d, h), p + "self_attn.k_proj.weight": (d, h),
              p + "self_attn.v_proj.weight": (d, h), p + "self_attn.o_proj.weight": (h, 2 * d),
              p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
              p + "mlp.down_proj.weight": (h, i)}
    return {n: torch.randn(s) for n, s in shapes.items()}


def _write_hf(d, tensors=None, config=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or HF_CONFIG))
    (d / "tokenizer.json").write_text(byte_level(260, 1, 2))
    save_file(tensors if tensors is not None else _hf_tensors(), str(d / "model.safetensors"))
    return d


def _open(path) -> Checkpoint:
    return open_checkpoint(ModelSpec(source=str(path)))


@pytest.fixture(autouse=True)
def _cache(digest_cache):
    return digest_cache


def test_good_checkpoint_loads(tmp_path):
    model = load_model(_open(_write_hf(tmp_path / "ok")))
    assert model.tok_embeddings.weight.shape == (260, 16)


def test_missing_tensor(tmp_path):
    t = _hf_tensors()
    del t["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.0\.mlp\.up_proj"
                       r"\.weight \(for layers\.0\.feed_forward\.w13\.weight\)"):
        _open(_write_hf(tmp_path / "m", t))


def test_extra_tensor(tmp_path):
    t = _hf_tensors()
    t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(16)
    t["model.rotary_emb.inv_freq"] = torch.zeros(4)          # on the ignore list: fine
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(not used by the model\): "
                       r"model\.layers\.0\.self_attn\.o_proj\.bias$"):
        _open(_write_hf(tmp_path / "x", t))


def test_misshapen_tensor(tmp_path):
    t = _hf_tensors()
    t["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(16, 15)
    ckpt = _open(_write_hf(tmp_path / "s", t))
    with pytest.raises(CheckpointError, match=r"tensor layers\.0\.attention\.wo\.weight has "
                       r"shape \[16, 15\], the model declares \[16, 16\]"):
        load_model(ckpt)


def test_misshapen_piece_of_fused_tensor(tmp_path):
    t = _hf_tensors()
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 12)
    ckpt = _open(_write_hf(tmp_path / "k", t))
    with pytest.raises(CheckpointError, match=r"cannot make layers\.0\.attention\.wqkv\.weight "
                       r"from .*k_proj\.weight \[8, 12\]"):
        load_model(ckpt)


def test_truncated_safetensors(tmp_path):
    d = _write_hf(tmp_path / "t")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors "
                       r"file \(truncated or corrupt\?\)"):
        _open(d)


def test_shard_truncated_after_it_was_opened(tmp_path):
    """The tensors are read with plain file reads: a short read names the shard and the
    tensor, as a truncated file at open does."""
    d = _write_hf(tmp_path / "t")
    ckpt = _open(d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read tensor "
                       r"\S+: \d+ of \d+ bytes \(truncated file\?\)"):
        load_model(ckpt)


def test_hf_tensors_equal_safetensors_own_reader(tmp_path):
    from safetensors.torch import load_file

    d = _write_hf(tmp_path / "r")
    want = load_file(str(d / "model.safetensors"))
    got = dict(_open(d).tensors(torch.float32))
    assert torch.equal(got["layers.0.attention.wo.weight"],
                       want["model.layers.0.self_attn.o_proj.weight"].float())


def test_shard_missing_from_index(tmp_path):
    d = _write_hf(tmp_path / "i")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: missing "
                       r"\(listed in model\.safetensors\.index\.json\)"):
        _open(d)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_missing_file(tmp_path, name):
    d = _write_hf(tmp_path / "f")
    (d / name).unlink()
    with pytest.raises(CheckpointError, match=rf"{name}: missing"):
        _open(d)


def test_no_weights(tmp_path):
    d = _write_hf(tmp_path / "w")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weight files"):
        _open(d)


def test_bad_config(tmp_path):
    d = _write_hf(tmp_path / "c", config={**HF_CONFIG, "model_type": "gpt2"})
    with pytest.raises(CheckpointError, match=r"config\.json: .*model_type 'gpt2' is not "
                       r"supported"):
        _open(d)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("model_type,key,value,message", [
    ("llama", "hidden_act", "gelu", "hidden_act='gelu' is not supported for model_type "
     "'llama'; supported: silu"),
    ("qwen3", "hidden_act", "relu", "hidden_act='relu' .*supported: silu"),
    ("llama", "rope_scaling", YARN, "rope_scaling.rope_type='yarn' is not supported for "
     "model_type 'llama'; supported: default, llama3"),
    ("qwen3", "rope_scaling", YARN, "rope_scaling.rope_type='yarn' .*'qwen3'"),
    ("llama", "attention_bias", True, "attention_bias=True .*supported: false"),
    ("qwen3", "attention_bias", True, "attention_bias=True .*'qwen3'; supported: false"),
    ("llama", "mlp_bias", True, "mlp_bias=True .*supported: false"),
    ("qwen2", "partial_rotary_factor", 0.5, "partial_rotary_factor=0.5 .*supported: 1.0"),
    ("llama", "final_logit_softcapping", 30.0, "final_logit_softcapping=30.0 .*no "
     "soft-capping"),
    ("qwen3", "attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("gemma", "model_type", "gemma", "model_type 'gemma' is not supported; supported: "
     "llama, mistral, qwen2, qwen3"),
])
def test_config_that_changes_the_math_is_refused(tmp_path, model_type, key, value, message):
    """A setting no block implements is refused naming the key, its value and what works,
    never read past (before, an unknown hidden_act or soft-capping built a wrong model)."""
    d = _write_hf(tmp_path / "m", config={**HF_CONFIG, "model_type": model_type, key: value})
    with pytest.raises(CheckpointError, match=r"config\.json: .*" + message):
        _open(d)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope: no such file or directory"):
        _open(tmp_path / "nope")


def test_missing_package_file():
    with pytest.raises(CheckpointError, match=r"package 'no_such_pkg_kiln' is not installed"):
        resolve_source("pkg://no_such_pkg_kiln/x.gguf")
    with pytest.raises(CheckpointError, match=r"no file 'missing\.gguf' in package 'builder'"):
        resolve_source("pkg://builder/missing.gguf")
    with pytest.raises(CheckpointError, match=r"unsupported scheme"):
        resolve_source("hf://org/model")


def test_not_a_checkpoint(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"weights\.bin: not a checkpoint"):
        _open(f)


def _tiny_gguf(path):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in dict(block_count=1, embedding_length=16, feed_forward_length=32,
                     head_count=2, head_count_kv=1).items():
        getattr(w, f"add_{k}")(v)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    w.add_token_merges(["a b"])
    for name, shape in (("token_embd.weight", (4, 16)), ("output_norm.weight", (16,))):
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_bad_magic(tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(CheckpointError, match=r"bad\.gguf: not a GGUF file \(magic b'GGML'"):
        _open(f)


def test_gguf_truncated(tmp_path):
    f = _tiny_gguf(tmp_path / "t.gguf")
    f.write_bytes(f.read_bytes()[:-40])
    with pytest.raises(CheckpointError, match=r"t\.gguf: corrupt or truncated GGUF"):
        _open(f)


def test_gguf_missing_tensors(tmp_path):
    f = _tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match=r"m\.gguf: missing tensors: blk\.0\.attn_norm"
                       r"\.weight \(for layers\.0\.attention_norm\.weight\)"):
        _open(f)


def test_revision_mismatch(tmp_path):
    d = _write_hf(tmp_path / "r")
    with pytest.raises(CheckpointError, match=r"differs from model\.revision 00ff"):
        open_checkpoint(ModelSpec(source=str(d), revision="00ff"))


def test_load_model_rejects_bad_streams():
    cfg = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=4)
    shapes = param_shapes(cfg)

    def ckpt(items):
        return Checkpoint(cfg, "{}", {}, "0", "test", _stream=lambda dtype: iter(items))

    full = [(n, torch.zeros(s)) for n, s in shapes.items()]
    assert load_model(ckpt(full)).norm.weight.shape == (8,)
    with pytest.raises(CheckpointError, match=r"tensor norm\.weight given twice"):
        load_model(ckpt(full + [("norm.weight", torch.zeros(8))]))
    with pytest.raises(CheckpointError, match=r"tensor output\.weight is not a parameter"):
        load_model(ckpt(full + [("output.weight", torch.zeros(8, 8))]))
    with pytest.raises(CheckpointError, match=r"test: missing tensors: norm\.weight$"):
        load_model(ckpt([x for x in full if x[0] != "norm.weight"]))


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    d = _write_hf(tmp_path / "m")
    (d / "tokenizer.json").write_text(byte_level(300, 1, 2))    # another model's tokenizer
    with pytest.raises(CheckpointError, match=r"tokenizer has 300 token ids but the model's "
                       r"vocabulary .* is 260: ids 260..299 have no embedding"):
        _open(d)
    cfg = dict(HF_CONFIG, eos_token_id=[2, 400])
    with pytest.raises(CheckpointError, match=r"eos_token_ids \[400\] outside the model's "
                       r"vocabulary of 260"):
        _open(_write_hf(tmp_path / "eos", config=cfg))


def test_random_model_with_a_larger_tokenizer_is_refused(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text(byte_level(300, 1, 2))
    arch = {"vocab_size": 260, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(ModelSpec(source="random", arch=arch, tokenizer=str(tok)))
    msg = str(e.value)
    assert "300 token ids" in msg and "vocab_size is 260" in msg and str(tok) in msg
    tok.write_text(byte_level(260, 1, 2))                    # as many ids: fine
    assert open_checkpoint(ModelSpec(source="random", arch=arch,
                                     tokenizer=str(tok))).config.vocab_size == 260


@pytest.mark.parametrize("template, problem", [
    ("{% for m in messages %}{{ raise_exception('roles must alternate') }}{% endfor %}",
     "roles must alternate"),
    ("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
     "loop iterations"),
    ("{{ 'a' * (2**24 + 1) }}", "went over a limit"),
    ("{% for m in messages %}{{ m.content }", "does not compile"),
])
def test_chat_template_that_cannot_render_is_refused_at_build(tmp_path, template, problem):
    """The chat template is rendered once on a sample conversation when the checkpoint is
    opened: one that fails or goes over a render limit never makes a plan."""
    d = _write_hf(tmp_path / "t")
    (d / "chat_template.jinja").write_text(template)
    with pytest.raises(CheckpointError, match="chat template cannot be served") as e:
        _open(d)
    assert problem in str(e.value)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert _open(d).generation["chat_template"]

"""Tiny HF checkpoints (save_pretrained) and GGUFs (GGUFWriter) through our loader, checked
token-for-token against transformers."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from kiln.builder.arch.weights import permute_rope
from kiln.builder.sources import load_model, open_checkpoint
from kiln.builder.sources.tokenizer_build import byte_level
from kiln.builder.spec import ModelSpec, RandomArch
from tests.helpers import greedy_generate

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers")

VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, initializer_range=0.1)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 10000.0}
CASES = {
    "llama": ("llama", dict(tie_word_embeddings=False), {}),
    "llama3_rope": ("llama", dict(tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE), {}),
    "qwen2_bias": ("qwen2", dict(tie_word_embeddings=False), {}),
    "tied": ("llama", dict(tie_word_embeddings=True), {}),
    "sharded": ("llama", dict(tie_word_embeddings=False), dict(max_shard_size="60KB")),
    # head_dim 32 while hidden / heads is 16: Qwen3 reads its own
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=32), {}),
    "qwen3_tied_sharded": ("qwen3", dict(tie_word_embeddings=True, head_dim=32),
                           dict(max_shard_size="60KB")),
}
PROMPTS = [[5, 77, 200, 31, 9], list(range(40, 51)), [300, 12] * 9 + [7]]
NEW_TOKENS = 32


def _hf_model(family: str, cfg_kw: dict, seed: int = 0):
    torch.manual_seed(seed)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}[family]
    model = cls[1](cls[0](**TINY, **cfg_kw)).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: make mapping errors show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None   # always generate NEW_TOKENS
    return model


def _write_tokenizer(d, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"):
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write(byte_level(VOCAB, 1, 2))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": chat_template, "eos_token": "</s>", "bos_token": "<s>"}, f)


@pytest.fixture(scope="module", params=list(CASES))
def hf_case(request, tmp_path_factory):
    family, cfg_kw, save_kw = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    model = _hf_model(family, cfg_kw)
    model.save_pretrained(d, **save_kw)
    _write_tokenizer(d)
    return request.param, d, model


def _compare_with_hf(ours, hf_model, shuffle: bool):
    got = greedy_generate(ours, PROMPTS, NEW_TOKENS, tokens_per_block=4, shuffle_blocks=shuffle)
    for i, prompt in enumerate(PROMPTS):
        x = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
            new = ref[0, len(prompt):].tolist()
            first = hf_model(x).logits[0, -1]
            last = hf_model(ref[:, :-1]).logits[0, -1]
        assert first.std() > 0.1, "logits too flat for a 1e-3 check to mean anything"
        assert (got.prefill_logits[i] - first).abs().max() < 1e-3
        assert (got.step_logits[i][-1] - last).abs().max() < 1e-3
        assert got.tokens[i] == new, f"prompt {i}"


def test_hf_dir_matches_transformers(hf_case, digest_cache):
    name, d, hf_model = hf_case
    ckpt = open_checkpoint(ModelSpec(source=str(d)))
    assert ckpt.source_desc == f"hf dir {d}"
    assert ckpt.config.tie_word_embeddings == (name in ("tied", "qwen3_tied_sharded"))
    assert ckpt.config.qk_norm == name.startswith("qwen3")
    assert ckpt.config.attention_bias == (name == "qwen2_bias")
    assert (ckpt.config.rope_scaling is not None) == (name == "llama3_rope")
    if "sharded" in name:
        assert (d / "model.safetensors.index.json").exists()
        assert len(list(d.glob("*.safetensors"))) > 1
    assert ckpt.generation == {"bos_token_id": 1, "eos_token_ids": [2], "pad_token_id": None,
                               "chat_template": "{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}", "add_bos_token": False}
    _compare_with_hf(load_model(ckpt), hf_model, shuffle=name != "llama")


def test_weights_digest_is_stable_and_cached(tmp_path, digest_cache):
    d = tmp_path / "ckpt"
    _hf_model("llama", dict(tie_word_embeddings=True)).save_pretrained(d)
    _write_tokenizer(d)
    a = open_checkpoint(ModelSpec(source=str(d))).weights_digest
    assert digest_cache.exists()
    assert open_checkpoint(ModelSpec(source=str(d))).weights_digest == a
    cfg = d / "config.json"
    st = cfg.stat()
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: recomputed, same
    assert open_checkpoint(ModelSpec(source=str(d), revision=a)).weights_digest == a


# --- GGUF written from a HF model ----------------------------------------------------------

def _add_weight(w, name: str, t: np.ndarray, dtype=np.float32, qtype: str | None = None):
    """A weight (2-D, or 3-D expert stack) as `dtype`, or quantized with gguf's own
    quantizer when qtype names a GGML type (e.g. "Q8_0"; benches write llama.cpp-sized files)."""
    if qtype is None:
        w.add_tensor(name, t.astype(dtype))
        return
    import gguf
    kind = gguf.GGMLQuantizationType[qtype]
    w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t, np.float32), kind),
                 raw_dtype=kind)


def _add_experts(w, hf_model, qtype: str | None = None):
    """llama.cpp's MoE keys and stacked expert tensors of a transformers Mixtral / Qwen3-MoE
    (in memory: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]); nothing for a
    dense model."""
    cfg = hf_model.config
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    w.add_expert_feed_forward_length(inter)
    for name, t in hf_model.state_dict().items():
        i = name.split(".")[2] if name.startswith("model.layers.") else None
        t = t.detach().float().numpy()
        if name.endswith(".mlp.gate.weight"):
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", t)
        elif name.endswith(".mlp.experts.gate_up_proj"):
            _add_weight(w, f"blk.{i}.ffn_gate_exps.weight", t[:, :inter], qtype=qtype)
            _add_weight(w, f"blk.{i}.ffn_up_exps.weight", t[:, inter:], qtype=qtype)
        elif name.endswith(".mlp.experts.down_proj"):
            _add_weight(w, f"blk.{i}.ffn_down_exps.weight", t, qtype=qtype)


def _add_tokenizer(w, pre: str, merges: bool = False) -> None:
    """The tests' byte-level vocabulary (VOCAB ids, bos 1, eos 2) as llama.cpp's gpt2
    tokenizer keys. merges: turn some reserved ids into BPE merges, which llama.cpp needs
    (benches run it on these files)."""
    tok = json.loads(byte_level(VOCAB, 1, 2))
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    pairs_used = []
    if merges:
        pairs = [(a, b) for a in "etaoin" for b in "etaoin"]
        slots = [i for i, t in enumerate(tokens) if t.startswith("<|reserved_")][-len(pairs):]
        for i, (a, b) in zip(slots, pairs):
            tokens[i] = a + b
            pairs_used.append(f"{a} {b}")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") and len(t) > 1 else 1 for t in tokens])
    w.add_token_merges(pairs_used)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


def _write_gguf(path, family: str, hf_model, dtype=np.float32, qtype: str | None = None):
    import gguf
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), family)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    if family in ("qwen3", "qwen3moe"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if family == "phi3":
        _write_phi3_rope(w, hf_model)
    elif family == "llama" and getattr(cfg, "sliding_window", None):   # Mistral's window
        w.add_sliding_window(cfg.sliding_window)
    _add_tokenizer(w, "qwen2" if family == "qwen2" else "smollm", merges=qtype is not None)
    w.add_chat_template("{{ messages[0]['content'] }}")
    names = {"embed_tokens": "token_embd", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # phi3: fused
    for name, t in hf_model.state_dict().items():
        if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
            continue                                          # _add_experts
        t = t.detach().float()
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            rest = name.removeprefix("model.")
            for hf, gg in names.items():
                rest = rest.replace(hf, gg)
            out = rest.replace("layers.", "blk.")
            if family == "llama" and ".attn_q." in out:       # llama.cpp's rope layout
                t = permute_rope(t, cfg.num_attention_heads)
            elif family == "llama" and ".attn_k." in out:
                t = permute_rope(t, cfg.num_key_value_heads)
        if t.ndim == 2:
            _add_weight(w, out, t.numpy(), dtype, qtype)
        else:
            w.add_tensor(out, t.numpy().astype(np.float32))
    _add_experts(w, hf_model, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_phi3_rope(w, hf_model):
    """llama.cpp's phi3 keys: rotary dims, the window, LongRoPE's factors as tensors."""
    cfg, rp = hf_model.config, hf_model.config.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(int(head_dim * rp.get("partial_rotary_factor", 1.0)))
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if rp.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(hf_model.model.rotary_emb.attention_scaling)
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], np.float32))


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("qwen2", False),
                                         ("qwen3", False), ("qwen3", True)])
def test_gguf_matches_hf(tmp_path, digest_cache, family, tied):
    extra = dict(head_dim=32) if family == "qwen3" else {}
    hf_model = _hf_model(family, dict(tie_word_embeddings=tied, **extra), seed=1)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, family, hf_model)
    ckpt = open_checkpoint(ModelSpec(source=str(path)))
    assert ckpt.source_desc == f"gguf {path} (F32)"
    assert ckpt.config.tie_word_embeddings == tied
    assert ckpt.config.attention_bias == (family == "qwen2")
    assert ckpt.generation["chat_template"] == "{{ messages[0]['content'] }}"
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir)
    _write_tokenizer(hf_dir)
    from_hf = dict(open_checkpoint(ModelSpec(source=str(hf_dir))).tensors())
    for name, t in ckpt.tensors():          # the GGUF, un-permuted, equals the HF source
        assert torch.equal(t, from_hf.pop(name)), name
    assert not from_hf
    tok = Tokenizer.from_str(ckpt.tokenizer_json)
    text = "héllo wörld 🤖</s>"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    _compare_with_hf(load_model(ckpt), hf_model, shuffle=True)


def test_gguf_f16_dequantized(tmp_path, digest_cache):
    hf_model = _hf_model("llama", dict(tie_word_embeddings=False), seed=2)
    path = tmp_path / "f16.gguf"
    _write_gguf(path, "llama", hf_model, dtype=np.float16)
    ckpt = open_checkpoint(ModelSpec(source=str(path)))
    got = dict(ckpt.tensors())
    ref = hf_model.state_dict()["model.layers.0.mlp.down_proj.weight"].half().float()
    assert torch.equal(got["layers.0.feed_forward.w2.weight"], ref)


# --- random ---------------------------------------------------------------------------------

ARCH = RandomArch(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def test_random_is_deterministic():
    a = open_checkpoint(ModelSpec(source="random", arch=ARCH, seed=0))
    b = open_checkpoint(ModelSpec(source="random", arch=ARCH, seed=0))
    c = open_checkpoint(ModelSpec(source="random", arch=ARCH, seed=1))
    assert a.weights_digest == b.weights_digest != c.weights_digest
    assert a.source_desc == "random seed 0"
    assert a.config.tie_word_embeddings and a.config.num_kv_heads == 2
    ta, tb, tc = dict(a.tensors()), dict(b.tensors()), dict(c.tensors())
    assert all(torch.equal(ta[n], tb[n]) for n in ta)
    assert not torch.equal(ta["tok_embeddings.weight"], tc["tok_embeddings.weight"])
    assert abs(ta["norm.weight"].mean().item() - 1) < 0.01
    assert abs(ta["layers.0.attention.wo.weight"].std().item() - 0.02) < 0.002
    tok = Tokenizer.from_str(a.tokenizer_json)
    assert tok.get_vocab_size() == 300
    assert tok.token_to_id("<s>") == 1 and tok.token_to_id("</s>") == 2
    text = "any bytes: ü 日本 🤖"
    assert tok.decode(tok.encode(text).ids) == text
    model = load_model(a)
    out = greedy_generate(model, [tok.encode("hello").ids], 4)
    assert len(out.tokens[0]) == 4


def test_random_small_vocab_tokenizer():
    arch = ARCH.model_copy(update={"vocab_size": 64})
    ckpt = open_checkpoint(ModelSpec(source="random", arch=arch))
    tok = Tokenizer.from_str(ckpt.tokenizer_json)
    assert tok.get_vocab_size() == 64
    assert max(tok.encode("zzz ~~~ ü").ids) < 64
    load_model(ckpt)


# --- GGUF tokenizers --------------------------------------------------------------------------

def test_gguf_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """A llama.cpp 'llama' (SentencePiece-style) vocabulary: ours equals transformers'."""
    import gguf
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "llo", "▁he",
              "▁hello", "▁w", "or", "ld", "▁wor", "▁world", "é", "ca", "▁ca", "f"]
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(toks), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(tmp_path / "sp.gguf"))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    from kiln.builder.sources.tokenizer_build import from_gguf_vocab
    ours = Tokenizer.from_str(from_gguf_vocab(meta, "sp.gguf"))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    for text in ["hello world", " hello  world", "café hello", "héllo\nworld 日本",
                 "hello</s>world", "", "  "]:
        ids = ours.encode(text).ids
        assert ids == hf(text).input_ids, text
        assert ids[0] == 1
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), text

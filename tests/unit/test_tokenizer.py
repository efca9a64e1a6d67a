"""Tokenizer, chat template, and the streaming detokenizer (byte-level test tokenizer)."""
import random

import pytest
from jinja2.exceptions import TemplateError

from tests.runtime_helpers import BOS, EOS, byte_tokenizer

pytestmark = pytest.mark.unit
TEXT = "héllo wörld — 日本語 🎉 ok"


def stream(tok, ids, chunks=1, **kw):
    d = tok.detokenizer(**kw)
    out, stop = [], None
    for i in range(0, len(ids), chunks):
        delta, stop = d.step(ids[i:i + chunks])
        out.append(delta)
        if stop:
            break
    out.append(d.flush())
    return out, stop


def test_encode_decode_roundtrip_and_bos():
    tok = byte_tokenizer()
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT.encode()) and tok.decode(ids) == TEXT
    tb = byte_tokenizer(add_bos=True)
    assert tb.encode("a") == [BOS, 97] and tb.encode("a", add_special_tokens=False) == [97]
    assert tok.decode([97, EOS]) == "a" and tok.decode([97, EOS], False) == "a</s>"


def test_incremental_never_splits_utf8():
    tok = byte_tokenizer()
    ids = tok.encode(TEXT)
    for chunks in (1, 2, 3):
        deltas, _ = stream(tok, ids, chunks)
        assert "".join(deltas) == TEXT
        for d in deltas:
            assert "\ufffd" not in d
            d.encode("utf-8")          # each delta is whole characters


def test_incremental_random_text_matches_full_decode():
    tok = byte_tokenizer()
    rng = random.Random(0)
    alphabet = "ab é日🎉\n"
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text)
        deltas, _ = stream(tok, ids, rng.randint(1, 4))
        assert "".join(deltas) == tok.decode(ids) == text


def test_invalid_bytes_flushed_at_end():
    tok = byte_tokenizer()
    ids = tok.encode("ok") + [0xE6, 0x97]          # a truncated 3-byte character
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)


def test_stop_string_across_token_boundaries():
    tok = byte_tokenizer()
    ids = tok.encode("hello STOP world")
    deltas, stop = stream(tok, ids, stop=["STOP"])
    assert stop == "STOP" and "".join(deltas) == "hello "
    # held-back text never leaks part of the stop string
    assert all("S" not in d for d in deltas)
    deltas, stop = stream(tok, ids, stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas) == "hello STOP"
    deltas, stop = stream(tok, ids, stop=["STOPX"])
    assert stop is None and "".join(deltas) == "hello STOP world"


def test_stop_string_with_multibyte_and_earliest_match():
    tok = byte_tokenizer()
    ids = tok.encode("ab日本cd")
    deltas, stop = stream(tok, ids, stop=["cd", "本"])
    assert stop == "本" and "".join(deltas) == "ab日"


def test_chat_template():
    tok = byte_tokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<s><|system|>be brief</s><|user|>hi</s><|assistant|>"
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant|>")
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids[0] == BOS and ids.count(EOS) == 2
    with pytest.raises(TemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        byte_tokenizer(chat_template=None).apply_chat_template(msgs)

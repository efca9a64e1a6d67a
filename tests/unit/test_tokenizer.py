"""Tokenizer, chat template, and the streaming detokenizer (byte-level test tokenizer)."""
import random
import threading
import time

import pytest

from kiln.runtime.chat_template import ChatTemplateError, vet_chat_template
from tests.runtime_helpers import BOS, CHAT_TEMPLATE, EOS, byte_tokenizer

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
    # the template's raise_exception refuses the messages: a ValueError (an invalid request)
    with pytest.raises(ValueError, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        byte_tokenizer(chat_template=None).apply_chat_template(msgs)


def test_encode_lets_other_threads_run():
    """A long text is tokenized without holding the GIL: another thread keeps running
    meanwhile (a tokenizer call that held it would stall the server's event loop)."""
    tok = byte_tokenizer()
    text = "hello world " * 30_000
    started, done = threading.Event(), threading.Event()
    ids = []

    def work():
        started.set()
        ids.extend(tok.encode(text))
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    turns = 0
    while not done.is_set():
        turns += 1
        time.sleep(0.001)
    t.join()
    assert len(ids) == len(text)
    assert turns >= 20, f"this thread ran {turns} times while encode ran"


def test_lone_surrogate_is_a_value_error():
    with pytest.raises(ValueError, match="lone surrogate"):
        byte_tokenizer().encode("ok \ud800")


def test_token_texts_decodes_each_id_once():
    tok = byte_tokenizer()
    assert tok.token_texts([104, 105, 104, EOS]) == {104: "h", 105: "i", EOS: "</s>"}


# Templates that would take minutes, gigabytes or the whole process (sized here so that an
# unbounded renderer still finishes: each is just over a limit)
HOSTILE = {
    "repeat": "{{ 'a' * (2**24 + 1) }}",
    "nested loops": "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}"
                    "{% endfor %}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(24) %}"
                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "macro calls": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                   "{% endmacro %}{{ f(15) }}",
    "format width": "{{ '{:>200000}'.format('x') }}",
    "indent": "{{ ('\n' * 10000)|indent(2000) }}",
    "output": "{% for i in range(17000) %}{{ 'y' * 1000 }}{% endfor %}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_are_refused(name):
    tok = byte_tokenizer(chat_template=HOSTILE[name])
    with pytest.raises(ValueError, match="limit"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_ordinary_templates_render_within_the_limits():
    tok = byte_tokenizer()
    msgs = [{"role": "user", "content": "x" * 2**20}] * 8     # 8 MiB of messages
    assert len(tok.apply_chat_template(msgs)) > 8 * 2**20
    looping = ("{% for m in messages %}{{ loop.index }} {{ m.role|upper }}: "
               "{{ m.content|trim }}{% if not loop.last %}, {% endif %}{% endfor %}"
               "{{ '%-5s|' % 'end' }}{{ '{:>4}'.format(7) }}")
    out = byte_tokenizer(chat_template=looping).apply_chat_template(
        [{"role": "user", "content": " hi "}] * 1000, add_generation_prompt=False)
    assert out.startswith("1 USER: hi, 2 USER: hi") and out.endswith("1000 USER: hiend  |   7")


def test_vet_chat_template():
    assert vet_chat_template(CHAT_TEMPLATE, "<s>", "</s>").endswith("<|assistant|>")
    with pytest.raises(ChatTemplateError, match="no system role"):
        vet_chat_template("{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        vet_chat_template("{% for %}")
    with pytest.raises(ChatTemplateError, match="limit"):
        vet_chat_template(HOSTILE["nested loops"])
    with pytest.raises(ChatTemplateError, match="a number of"):    # not computed
        vet_chat_template("{{ 7 ** (2**40) }}")

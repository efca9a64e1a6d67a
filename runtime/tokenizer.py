"""The plan's tokenizer (`tokenizer.json`, Hugging Face `tokenizers`), its chat template, and
the streaming detokenizer.

Streaming text must never split a UTF-8 character: a byte-level BPE token can carry half a
character, and decoding it alone gives U+FFFD. The detokenizer decodes a small window of
recent tokens and emits the new text only once it no longer ends in a partial character
(vLLM's prefix/read offsets). Stop strings are matched on the text, also when a stop string
spans tokens: text that could still be the start of a stop string is held back until it is
known not to be.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence

from kiln.runtime.chat_template import ChatTemplate, TemplateLimits

REPLACEMENT = "\ufffd"


class Tokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`.

    `generation`: {bos_token_id, eos_token_ids, chat_template, add_bos_token} (the plan's
    generation.json; missing keys mean none / False)."""

    def __init__(self, tokenizer, generation: Optional[dict] = None):
        gen = dict(generation or {})
        self._tok = tokenizer
        self.bos_token_id: Optional[int] = gen.get("bos_token_id")
        eos = gen.get("eos_token_ids", gen.get("eos_token_id", ()))
        self.eos_token_ids: tuple[int, ...] = tuple([eos] if isinstance(eos, int) else eos or ())
        self.chat_template: Optional[str] = gen.get("chat_template")
        self.add_bos_token: bool = bool(gen.get("add_bos_token", False))
        self.generation = gen
        self._template: Optional[ChatTemplate] = None
        self.template_limits = TemplateLimits()

    @classmethod
    def from_file(cls, path: str | Path, generation: Optional[dict] = None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        return cls(HFTokenizer.from_file(str(path)), generation)

    @classmethod
    def from_plan(cls, plan) -> "Tokenizer":
        """From a runtime.plan.Plan: the bytes of tokenizer.json and generation.json that
        load_plan read and checked (the files are not read again)."""
        from tokenizers import Tokenizer as HFTokenizer

        from kiln.runtime.plan import TOKENIZER_FILE
        return cls(HFTokenizer.from_buffer(plan.data_file(TOKENIZER_FILE)), plan.generation)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json text (what grammar compilers read the vocabulary from)."""
        return self._tok.to_str()

    def token_text(self, token_id: Optional[int]) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")

    @property
    def bos_token(self) -> str:
        return self.token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self.token_text(self.eos_token_ids[0] if self.eos_token_ids else None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, a bos is prepended when the generation
        config asks for one (add_bos_token) and the tokenizer did not add it already."""
        check_text(text)
        # encode_batch releases the GIL while it works (encode holds it): a long prompt
        # tokenized on a worker thread never stalls the event loop or the engine thread
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """Each distinct id's text (special tokens spelled out), decoded in one batch without
        the GIL: the cost is bounded by the vocabulary, whatever the number of ids."""
        ids = sorted(set(token_ids))
        texts = self._tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
        return dict(zip(ids, texts))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **extra):
        """Render `messages` with the chat template (Hugging Face semantics: variables
        messages, bos_token, eos_token, add_generation_prompt; raise_exception), under
        runtime/chat_template.py's limits. Returns the text, or its token ids (no special
        tokens added: the template writes them). Raises ChatTemplateError (a ValueError)."""
        if not self.chat_template:
            raise ValueError("this plan's tokenizer has no chat template; send a plain prompt")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template, self.template_limits)
        text = self._template.render(messages=messages, bos_token=self.bos_token,
                                     eos_token=self.eos_token,
                                     add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def detokenizer(self, prompt_token_ids: Sequence[int] = (), stop: Iterable[str] = (),
                    include_stop_str_in_output: bool = False,
                    skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_token_ids, stop, include_stop_str_in_output,
                                      skip_special_tokens)


def check_text(text: str) -> None:
    """ValueError for text that is not valid Unicode (a lone surrogate, which JSON's \\ud800
    escapes can carry): it has no UTF-8 form to tokenize."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode: a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas.

    step(ids) -> (delta, stop): deltas never split a UTF-8 character and, concatenated with
    flush(), equal the decode of the output tokens (in the context of the prompt's last
    tokens), cut at the first stop string when one appears (stop = the string).
    """

    CONTEXT = 6  # prompt tokens decoded before the output, for correct leading spaces

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 stop: Iterable[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars held back
        self.text = ""       # output text so far (after any stop cut)
        self.sent = 0        # chars of self.text already returned
        self.stopped: Optional[str] = None

    def step(self, token_ids: Sequence[int]) -> tuple[str, Optional[str]]:
        """Add output tokens -> (text delta, the stop string matched or None)."""
        if self.stopped is not None:
            return "", self.stopped
        self.ids.extend(token_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return "", None  # a character still incomplete: wait for its next bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._add(full[len(prefix):])

    def flush(self) -> str:
        """The text still held back (at the end of the request)."""
        delta = ""
        if self.stopped is None:
            prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
            full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
            self.prefix_offset = self.read_offset = len(self.ids)
            if len(full) > len(prefix):
                delta, _ = self._add(full[len(prefix):])
        rest, self.sent = self.text[self.sent:], len(self.text)
        return delta + rest

    def _add(self, new: str) -> tuple[str, Optional[str]]:
        start = max(0, len(self.text) - self.hold)   # a stop string may begin in held text
        self.text += new
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (self.stopped is None or i < self._cut):
                self.stopped, self._cut = s, i
        if self.stopped is not None:
            self.text = self.text[:self._cut + (len(self.stopped) if self.include_stop else 0)]
            delta, self.sent = self.text[self.sent:], len(self.text)
            return delta, self.stopped
        end = len(self.text) - self.hold if self.stop else len(self.text)
        if end <= self.sent:
            return "", None
        delta, self.sent = self.text[self.sent:end], end
        return delta, None

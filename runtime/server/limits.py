"""Caps on what one request may ask of the server, checked at the API boundary before any
work is done for it (`kiln serve` flags; defaults are far above what a plan can serve).

    HTTP body / gRPC message  > max_request_bytes  -> 413 / RESOURCE_EXHAUSTED (not read)
    prompt text, chat messages and tools (every string the chat template sees)
                              > max_prompt_bytes   -> 400 / INVALID_ARGUMENT (not tokenized)
    stop strings/ids, bad words, prompts, messages > their cap -> 400 / INVALID_ARGUMENT
    an output constraint's schema/regex/grammar/choices > max_guided_bytes, choices >
        max_guided_choices, OpenAI tools > max_tools -> 400 / INVALID_ARGUMENT (not compiled)
    logprob entries of a whole (not streamed) response > max_logprob_entries -> 400
    requests in flight on one ModelStreamInfer stream = max_stream_requests -> the stream
        is not read further until one ends (HTTP/2 flow control throttles the client)

The gRPC services and the HTTP API check the same RequestLimits through the Frontend, so a
request is refused the same way whichever API it came through.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sized

from kiln.contracts import FieldError
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.server.errors import invalid

MiB = 2**20


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = 16 * MiB     # one HTTP body or one gRPC message
    max_prompt_bytes: Optional[int] = None  # prompt text (UTF-8); None: 64 x max_input_len,
    #                                         at least 1 MiB (a token of text is < 64 bytes)
    max_stop: int = 64                    # stop strings, and stop token ids, per request
    max_bad_words: int = 64               # bad words + bad token ids per request
    max_word_bytes: int = 1024            # each stop string / bad word
    max_prompts: int = 64                 # prompts x n choices of one OpenAI request
    max_messages: int = 1024              # chat messages per request
    max_stream_requests: int = 64         # requests in flight on one ModelStreamInfer stream
    max_guided_bytes: int = 256 * 2**10   # one constraint's text: schema, regex, grammar, or
    #                                       all its choices together (tool schemas included)
    max_guided_choices: int = 256         # guided_choice entries
    max_tools: int = 128                  # OpenAI tools per request (OpenAI's own cap)
    max_logprob_entries: int = 1 << 20    # choices x max_tokens x (1 + top logprobs) of one
    #                                       response that is not streamed

    def __post_init__(self):
        for name, value in vars(self).items():
            if value is not None and value < 1:
                raise FieldError(name, f"must be >= 1 (got {value})")

    def prompt_bytes(self, max_input_len: int) -> int:
        return self.max_prompt_bytes or max(MiB, 64 * max_input_len)

    def check_count(self, name: str, items: Sized, cap: int) -> None:
        if len(items) > cap:
            raise invalid(f"{name} has {len(items)} entries; at most {cap} are allowed "
                          "(a kiln serve limit)")

    def check_prompt(self, prompt, max_input_len: int, extra=None) -> None:
        """Text, chat messages or token ids, before tokenization; `extra`: what else reaches
        the chat template (OpenAI tools). Chat counts every string the template can see
        (roles, names, tool calls and their arguments, tools), not only the contents.
        Raises ServiceError."""
        cap = self.prompt_bytes(max_input_len)
        if isinstance(prompt, str):
            size = len(prompt.encode("utf-8", "surrogatepass"))
        elif len(prompt) and isinstance(prompt[0], dict):
            self.check_count("messages", prompt, self.max_messages)
            size = template_bytes((prompt, extra), cap)
        else:
            if len(prompt) > max_input_len:
                raise invalid(f"the prompt has {len(prompt)} tokens; max_input_len is "
                              f"{max_input_len}")
            return
        if size > cap:
            said = f"{size}" if isinstance(prompt, str) else f"more than {cap}"
            raise invalid(f"the prompt is {said} bytes; at most {cap} are allowed (it could "
                          f"not fit max_input_len = {max_input_len} tokens)")

    def check_params(self, p: SamplingParams) -> None:
        """The per-request lists of SamplingParams. Raises ServiceError."""
        self.check_count("stop", p.stop, self.max_stop)
        self.check_count("stop_token_ids", p.stop_token_ids, self.max_stop)
        self.check_count("bad_words", p.bad_words + tuple(map(str, p.bad_token_ids)),
                         self.max_bad_words)
        for name in ("stop", "bad_words"):
            for w in getattr(p, name):
                if len(w.encode("utf-8", "surrogatepass")) > self.max_word_bytes:
                    raise invalid(f"a {name} entry is longer than {self.max_word_bytes} bytes "
                                  "(a kiln serve limit)")
        if p.guided is not None:
            self.check_guided(p.guided)

    def check_guided(self, g) -> None:
        """One output constraint (runtime.guided.GuidedDecoding), before it is compiled."""
        self.check_count("guided_choice", g.choices, self.max_guided_choices)
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in (g.spec, *g.choices))
        if size > self.max_guided_bytes:
            what = {"json": "JSON schema", "choice": "choices"}.get(g.kind, g.kind)
            raise invalid(f"the output constraint's {what} is {size} bytes; at most "
                          f"{self.max_guided_bytes} are allowed (a kiln serve limit)")


def template_bytes(value, cap: int) -> int:
    """UTF-8 bytes of every string (keys included) and number in a JSON-like value, walked
    without recursion; stops counting once past `cap` (any result > cap means too large)."""
    size, stack = 0, [value]
    while stack and size <= cap:
        v = stack.pop()
        if isinstance(v, str):
            size += len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            size += len(repr(v)) if abs(v) < 1e300 else 400
    return size

"""The OpenAI API's requests and responses, for the HTTP frontend (openai_http.py).

A request body is checked in three passes, each refusal a 400 that names the parameter:

    body --refused parameters (logit_bias, audio, ...)--> --pydantic (types, unknown
    fields)--> --SamplingParams (ranges)--> OpenAIRequest: one (prompt token ids,
    SamplingParams) per choice, prompt after prompt, n choices each

Structured output (response_format, guided_*) and tools: openai_tools.py; a schema or
grammar that does not compile is refused by the engine at submission (400), never mid-stream.

Parameters Kiln cannot honour are refused, never ignored; `user` and a few bookkeeping fields
(metadata, store=false, service_tier, safety_identifier, prompt_cache_key) are accepted and
have no effect on the output. Logprobs are of the raw model distribution (before penalties
and temperature).
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from kiln.contracts import FieldError
from kiln.runtime.engine import RequestOutput, Usage
from kiln.runtime.sampling import MAX_LOGPROBS, SEED_MAX, SamplingParams, TokenLogprobs
from kiln.runtime.server.openai_tools import GUIDED_PARAMS, ToolError, Tools, guided_of, \
    parse_tools, render_messages
from kiln.runtime.tokenizer import Tokenizer

MAX_N = 64   # choices per prompt


class OpenAIError(Exception):
    """An error answered as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                       param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: Optional[str] = None,
            code: Optional[str] = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


# ---- parameters Kiln refuses, each with the value that means "not used" ------------------------
def _off(v) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


REFUSED: dict[str, tuple[Any, str]] = {
    # name: (test of a value that is harmless, why it is refused)
    "functions": (_off, "function calling is not supported"),
    "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
    "logit_bias": (_off, "logit_bias is not supported"),
    "audio": (_off, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "prediction": (_off, "predicted outputs are not supported"),
    "reasoning_effort": (_off, "reasoning_effort is not supported"),
    "verbosity": (_off, "verbosity is not supported"),
    "web_search_options": (_off, "web search is not supported"),
    "best_of": (lambda v: v in (None, 1), "best_of > 1 is not supported; use n"),
    "suffix": (_off, "suffix (insertion) is not supported"),
    "echo": (_off, "echo is not supported"),
    "store": (_off, "storing completions is not supported"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None   # vLLM: usage on every chunk


class _Common(_Strict):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None
    # accepted, no effect on the output (bookkeeping of OpenAI's platform)
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None     # Kiln's prefix cache needs no key
    parallel_tool_calls: Optional[bool] = None  # false: tool_choice required makes one call
    # structured output (openai_tools.py): response_format, or vLLM's guided_* (extra_body)
    response_format: Optional[dict] = None
    guided_json: Union[dict, str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # Kiln (and vLLM) extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    max_draft_tokens: Optional[int] = None    # speculative drafts a step at most (0: none)


class CompletionBody(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None


class ChatBody(_Common):
    messages: list[dict]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Union[str, dict, None] = None


@dataclass
class OpenAIRequest:
    """A validated completion or chat request: its choices, each (prompt ids, params), prompt
    after prompt."""
    kind: Literal["completion", "chat"]
    model: str
    choices: list[tuple[list[int], SamplingParams]]
    prompts: list[list[int]]          # distinct prompts (usage counts each once)
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: bool
    tools: Optional[Tools] = None     # chat with tools: replies may become tool_calls
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _validate(model: type[BaseModel], body: dict) -> Any:
    for name, (harmless, why) in REFUSED.items():
        if name in body and not harmless(body[name]):
            raise invalid(f"{name}: {why} by Kiln", name, "unsupported_parameter")
    try:   # what is left of the refused parameters is harmless: not used
        return model.model_validate({k: v for k, v in body.items() if k not in REFUSED})
    except ValidationError as e:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "extra_forbidden":
            raise invalid(f"unknown parameter {param!r}: Kiln does not support it", param,
                          "unknown_parameter")
        if err["type"] == "missing":
            raise invalid(f"missing required parameter {param!r}", param, "missing_parameter")
        raise invalid(f"{param}: {err['msg']} (got {err.get('input')!r})"[:500], param)


def _guided(b: _Common, tools: Optional[Tools] = None):
    """The request's output constraint (GuidedDecoding or None); 400 naming a bad one."""
    try:
        guided, name = guided_of({k: getattr(b, k) for k in GUIDED_PARAMS})
        forced = tools.guided(b.parallel_tool_calls is not False) if tools else None
    except ToolError as e:
        raise invalid(str(e), e.param)
    if forced is not None and guided is not None:
        raise invalid(f"{name} and tool_choice {tools.choice} both constrain the output; "
                      "give one", name)
    return forced or guided


def _params(b: _Common, max_tokens: Optional[int], logprobs: Optional[int],
            renames: dict[str, str], guided=None) -> SamplingParams:
    if b.temperature is not None and not 0 <= b.temperature <= 2:
        raise invalid(f"temperature must be in [0, 2] (got {b.temperature})", "temperature")
    kw = {k: getattr(b, k) for k in ("temperature", "top_p", "presence_penalty",
                                     "frequency_penalty", "seed", "top_k", "min_p",
                                     "repetition_penalty", "min_tokens", "ignore_eos",
                                     "skip_special_tokens", "include_stop_str_in_output",
                                     "max_draft_tokens")
          if getattr(b, k) is not None}
    kw.update(max_tokens=max_tokens, logprobs=logprobs, guided=guided,
              stop=b.stop or (), stop_token_ids=tuple(b.stop_token_ids or ()))
    try:
        return SamplingParams(**kw)
    except FieldError as e:         # the SamplingParams field, by its name in this API
        name = renames.get(e.field, e.field)
        raise invalid(f"{name} {e.problem}", name)
    except ValueError as e:
        raise invalid(str(e), None)


def _n(b: _Common) -> int:
    n = 1 if b.n is None else b.n
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}] (got {n})", "n")
    return n


def _choices(prompts: list[list[int]], n: int, params: SamplingParams
             ) -> list[tuple[list[int], SamplingParams]]:
    """n choices per prompt; a seeded request gives choice i the seed + i (distinct choices,
    each reproducible)."""
    out = []
    for ids in prompts:
        for i in range(n):
            p = params
            if p.seed is not None and i:   # wraps past the largest seed
                seed = p.seed + i
                p = dataclasses.replace(p, seed=seed - 2**64 if seed > SEED_MAX else seed)
            out.append((ids, p))
    return out


def _stream_flags(b: _Common) -> tuple[bool, bool, bool]:
    stream = bool(b.stream)
    if b.stream_options is not None and not stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    so = b.stream_options or StreamOptions()
    return stream, bool(so.include_usage), bool(so.continuous_usage_stats)


def _prompt_ids(p, tok: Tokenizer) -> list[list[int]]:
    """A completion's prompt(s) -> token ids per prompt."""
    if not isinstance(p, str) and not p:
        raise invalid("prompt is empty", "prompt")
    if isinstance(p, str) or isinstance(p[0], str):
        try:
            return [tok.encode(x) for x in ([p] if isinstance(p, str) else p)]
        except ValueError as e:     # text with no UTF-8 form (a lone surrogate)
            raise invalid(f"prompt: {e}", "prompt")
    return [list(p)] if isinstance(p[0], int) else [list(x) for x in p]


def parse_completion(body: dict, tok: Tokenizer) -> OpenAIRequest:
    b: CompletionBody = _validate(CompletionBody, body)
    prompts = _prompt_ids(b.prompt, tok)
    if b.logprobs is not None and not 0 <= b.logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}] (got {b.logprobs})", "logprobs")
    params = _params(b, 16 if b.max_tokens is None else b.max_tokens, b.logprobs, {},
                     _guided(b))
    n = _n(b)
    stream, usage, cont = _stream_flags(b)
    return OpenAIRequest("completion", b.model, _choices(prompts, n, params), prompts, n,
                         stream, usage, cont, b.logprobs is not None)


def chat_messages(raw: list) -> list[dict]:
    """OpenAI chat messages -> the template's {role, content[, name][, tool_calls]} dicts
    (tool messages and assistant tool calls: openai_tools.render_messages renders them)."""
    if not raw:
        raise invalid("messages is empty", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object", where)
        for k in m:
            if k in ("function_call", "audio", "refusal") and not _off(m[k]):
                raise invalid(f"{where}.{k}: function_call (use tools), audio and refusal "
                              "are not supported by Kiln", f"{where}.{k}",
                              "unsupported_parameter")
            if k not in ("role", "content", "name", "tool_calls", "function_call",
                         "tool_call_id", "audio", "refusal"):
                raise invalid(f"unknown parameter {where}.{k}", f"{where}.{k}",
                              "unknown_parameter")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise invalid(f"{where}.role {role!r}: Kiln supports system, developer, user, "
                          "assistant and tool messages", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise invalid(f"{where}.content[{j}]: only text parts are supported "
                                  f"(got {kind!r})", f"{where}.content[{j}]",
                                  "unsupported_parameter")
                texts.append(part["text"])
            content = "\n".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise invalid(f"{where}.content must be a string or a list of text parts",
                          f"{where}.content")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        calls = m.get("tool_calls")
        if not _off(calls):
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise invalid(f"{where}.tool_calls: an assistant message's list of "
                              "{id, type, function: {name, arguments}}", f"{where}.tool_calls")
            msg["tool_calls"] = calls
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def parse_chat(body: dict, tok: Tokenizer, max_seq_len: int) -> OpenAIRequest:
    b: ChatBody = _validate(ChatBody, body)
    messages = chat_messages(b.messages)
    if not tok.chat_template:
        raise invalid("this model's plan has no chat template; use /v1/completions",
                      "messages", "no_chat_template")
    try:
        tools = parse_tools(b.tools, b.tool_choice)
    except ToolError as e:
        raise invalid(str(e), e.param)
    guided = _guided(b, tools)
    messages, extra = render_messages(messages, tools, tok.chat_template)
    try:
        ids = tok.apply_chat_template(messages, tokenize=True, **extra)
    except ValueError as e:  # ChatTemplateError (it says why), or text that is not Unicode
        raise invalid(str(e), "messages")
    if (b.max_tokens is not None and b.max_completion_tokens is not None
            and b.max_tokens != b.max_completion_tokens):
        raise invalid("give max_completion_tokens or max_tokens, not two different values",
                      "max_completion_tokens")
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    renames = {"max_tokens": "max_completion_tokens" if b.max_completion_tokens is not None
               else "max_tokens", "logprobs": "top_logprobs"}
    if max_tokens is None:      # OpenAI's default: as long as the context allows
        max_tokens = max(1, max_seq_len - len(ids))
    if b.top_logprobs is not None and not b.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    top = b.top_logprobs or 0
    if not 0 <= top <= MAX_LOGPROBS:
        raise invalid(f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {top})",
                      "top_logprobs")
    params = _params(b, max_tokens, top if b.logprobs else None, renames, guided)
    n = _n(b)
    stream, usage, cont = _stream_flags(b)
    return OpenAIRequest("chat", b.model, _choices([ids], n, params), [ids], n, stream, usage,
                         cont, bool(b.logprobs),
                         tools if tools is not None and tools.in_prompt else None)


# ---- responses ---------------------------------------------------------------------------------
FINISH = {"stop": "stop", "length": "length"}


def usage_json(usages: list[Optional[Usage]], n: int) -> dict:
    """usages: one per choice (prompt after prompt, n each). The prompt is counted once per
    prompt (with the cached tokens of its first choice); completions are summed. Speculative
    drafts, where any were verified, go into completion_tokens_details the way OpenAI counts
    a prediction's tokens: accepted_prediction_tokens kept, rejected_prediction_tokens not."""
    prompt = cached = completion = drafted = accepted = 0
    for i, u in enumerate(usages):
        if u is None:
            continue
        if i % n == 0:
            prompt += u.prompt_tokens
            cached += u.cached_tokens
        completion += u.completion_tokens
        drafted += u.draft_tokens
        accepted += u.accepted_draft_tokens
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if drafted:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def _texts(tok: Tokenizer, lps: list[TokenLogprobs]) -> dict[int, str]:
    """The text of every token (and alternative) of `lps`, each distinct id decoded once."""
    return tok.token_texts(i for lp in lps for i in (lp.token_id, *(t for t, _ in lp.top)))


def completion_logprobs(tok: Tokenizer, lps: list[TokenLogprobs], offset: int) -> dict:
    """The legacy completions format; offset = chars of text before these tokens."""
    texts = _texts(tok, lps)
    tokens, offsets = [], []
    for lp in lps:
        t = texts[lp.token_id]
        tokens.append(t)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{texts[i]: v for i, v in lp.top} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprobs]) -> dict:
    spelled = {i: (t, list(t.encode("utf-8"))) for i, t in _texts(tok, lps).items()}

    def entry(token_id, logprob):
        t, b = spelled[token_id]
        return {"token": t, "logprob": logprob, "bytes": b}
    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps],
            "refusal": None}


class ChoiceState:
    """What has been sent of one choice (streaming) or gathered (not streaming)."""

    def __init__(self):
        self.text = ""
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: Optional[str] = None
        self.usage: Optional[Usage] = None
        self.started = False     # chat: the role delta went out

    def add(self, out: RequestOutput) -> tuple[str, list[TokenLogprobs]]:
        offset = len(self.text)
        self.text += out.text
        new = list(out.logprobs or ())
        self.logprobs += new
        self.usage = out.usage
        if out.finished:
            self.finish_reason = FINISH.get(out.finish_reason, out.finish_reason)
        return self.text[offset:], new


def envelope(job: OpenAIRequest, model: str, fingerprint: str, chunk: bool) -> dict:
    if job.kind == "completion":
        return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created,
                "model": model, "system_fingerprint": fingerprint}
    return {"id": f"chatcmpl-{job.id}",
            "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": job.created, "model": model, "system_fingerprint": fingerprint}


def final_json(job: OpenAIRequest, states: list[ChoiceState], tok: Tokenizer, model: str,
               fingerprint: str) -> dict:
    choices = []
    for i, st in enumerate(states):
        if job.kind == "completion":
            choices.append({"index": i, "text": st.text, "finish_reason": st.finish_reason,
                            "logprobs": completion_logprobs(tok, st.logprobs, 0)
                            if job.logprobs else None})
        else:
            message = {"role": "assistant", "content": st.text, "refusal": None}
            finish = st.finish_reason
            if job.tools:               # calls, content, or the calls completed before a cut
                made = job.tools.reply(st.text, finish)
                message["content"], finish = made.content, made.finish_reason
                if made.calls:
                    message["tool_calls"] = list(made.calls)
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": chat_logprobs(tok, st.logprobs) if job.logprobs
                            else None})
    return {**envelope(job, model, fingerprint, False), "choices": choices,
            "usage": usage_json([s.usage for s in states], job.n)}


def chunk_json(job: OpenAIRequest, index: int, st: ChoiceState, out: RequestOutput, tok: Tokenizer,
               base: dict) -> Optional[dict]:
    """The SSE chunk for one output of choice `index` (None when there is nothing to say)."""
    offset = len(st.text)
    text, lps = st.add(out)
    finish = st.finish_reason if out.finished else None
    if job.kind == "chat" and job.tools is not None:
        choice = _tool_choice_chunk(job, index, st, text, lps, finish, tok)
        if choice is None:
            return None
    elif not text and not lps and finish is None and (job.kind == "completion" or st.started):
        return None
    elif job.kind == "completion":
        choice = {"index": index, "text": text, "finish_reason": finish,
                  "logprobs": completion_logprobs(tok, lps, offset) if job.logprobs else None}
    else:
        delta: dict = {}
        if not st.started:
            delta["role"] = "assistant"
            st.started = True
        if text or "role" in delta:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish,
                  "logprobs": chat_logprobs(tok, lps) if job.logprobs and lps else None}
    chunk = {**base, "choices": [choice]}
    if job.include_usage:
        chunk["usage"] = (usage_json([out.usage], 1) if job.continuous_usage else None)
    return chunk


def _tool_choice_chunk(job: OpenAIRequest, index: int, st: ChoiceState, text: str, lps: list,
                       finish: Optional[str], tok: Tokenizer) -> Optional[dict]:
    """A chat chunk's choice when the request has tools. A named tool_choice streams its
    arguments as they come (the call's id and name in the first delta); required and auto
    send the role first and the tool calls (or the content) once the reply is complete."""
    delta: dict = {}
    if not st.started:
        delta["role"] = "assistant"
        st.started = True
    if job.tools.choice == "named":
        call: dict = {"index": 0, "function": {"arguments": text}}
        if "role" in delta:
            call.update(id=f"call_{uuid.uuid4().hex[:24]}", type="function")
            call["function"] = {"name": job.tools.named, "arguments": text}
            delta["content"] = None
        if text or "role" in delta:
            delta["tool_calls"] = [call]
        if finish is not None:      # tool_calls once the arguments are complete
            finish = job.tools.reply(st.text, finish).finish_reason
        logprobs = chat_logprobs(tok, lps) if job.logprobs and lps else None
    else:
        if finish is None:
            return {"index": index, "delta": delta, "finish_reason": None,
                    "logprobs": None} if delta else None
        made = job.tools.reply(st.text, finish)
        if made.calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(made.calls)]
        if made.content is not None:
            delta["content"] = made.content
        finish = made.finish_reason
        logprobs = chat_logprobs(tok, st.logprobs) if job.logprobs and st.logprobs else None
    if not delta and finish is None:
        return None
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

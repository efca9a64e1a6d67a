"""Structured output and tool calling for the OpenAI API (openai_protocol.py uses these).

Constraints a request may carry (at most one), each compiled by the engine at submission:

    response_format {"type": "json_object"}               -> any JSON object
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    guided_json / guided_regex / guided_choice / guided_grammar   (vLLM's names, extra_body)
    tools + tool_choice "required"                         -> [{"name", "parameters"}, ...]
    tools + tool_choice {"type": "function", ...}          -> that function's arguments

Tools reach the model through the chat template: a template that reads `tools` gets them
as is; otherwise (SmolLM2's and most small models' templates) a system message lists them
and asks for `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (the Hermes/Qwen
format). tool_choice "auto" is unconstrained: a reply made of such blocks whose names are
tools becomes tool_calls, anything else is content. "none" leaves the tools out.

The constraint reads each function's parameters as strict function calling does
(`strict_parameters`): an object schema without additionalProperties allows only its declared
properties, each at most once, in the schema's order. Without parallel_tool_calls the array
closes after one call; with it the model may start another, up to MAX_TOOL_CALLS.

Replies are read linearly (`Tools.reply`): the JSON decoder at known offsets, `str.find` for
the tags, no backtracking regex, and an auto reply longer than MAX_TOOL_REPLY_CHARS is content
without being scanned. A reply constrained to tool calls that ends before its calls are
complete (max_tokens, a stop string) never becomes content: it carries the calls it completed
and says why it ended (finish_reason length or stop).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from kiln.runtime.guided import GuidedDecoding

GUIDED_PARAMS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar")

TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described as JSON schemas within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one JSON object per call, each within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <arguments-object>}}\n</tool_call>")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"[ \t\n\r]*")          # JSON's whitespace: one greedy class, linear
_DECODER = json.JSONDecoder()
# The most of an auto (unconstrained) reply scanned for <tool_call> blocks: a longer reply is
# content. Scanning is linear; the cap bounds what one reply costs the server (milliseconds).
MAX_TOOL_REPLY_CHARS = 1 << 20
# The most calls one reply makes: the constraint's array holds at most this many, and an auto
# reply with more blocks is content (each call costs an id and a JSON rewrite)
MAX_TOOL_CALLS = 128
# JSON levels a function's parameters may nest (the schema is walked and written recursively)
MAX_PARAMETERS_DEPTH = 64


class ToolError(ValueError):
    """A bad tools/response_format parameter: `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def guided_of(fields: dict) -> tuple[Optional[GuidedDecoding], Optional[str]]:
    """(the constraint, the parameter that gave it) from a body's structured-output fields
    (None values are absent). Raises ToolError."""
    given = [k for k in GUIDED_PARAMS if fields.get(k) is not None
             and not (k == "response_format" and fields[k].get("type") == "text")]
    if len(given) > 1:
        raise ToolError(f"give one output constraint, not {' and '.join(given)}", given[1])
    if not given:
        return None, None
    name = given[0]
    v = fields[name]
    try:
        if name == "response_format":
            return _response_format(v), name
        if name == "guided_json":
            return GuidedDecoding.json_schema(v), name
        if name == "guided_regex":
            return GuidedDecoding("regex", v), name
        if name == "guided_choice":
            return GuidedDecoding("choice", choices=tuple(v)), name
        return GuidedDecoding("grammar", v), name
    except ValueError as e:
        raise ToolError(f"{name}: {e}", name) from None


def _response_format(rf: dict) -> GuidedDecoding:
    kind = rf.get("type")
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind != "json_schema":
        raise ValueError(f"type {kind!r}: one of text, json_object, json_schema")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js:
        raise ValueError("json_schema needs a `schema` (and a `name`)")
    return GuidedDecoding.json_schema(js["schema"])


@dataclass(frozen=True)
class ToolReply:
    """What a finished chat reply of a request with tools is."""
    content: Optional[str]             # the reply as text; None when it is (or began) calls
    calls: tuple[dict, ...]            # the complete OpenAI tool_calls it made
    finish_reason: str                 # tool_calls (all calls complete) | stop | length


@dataclass(frozen=True)
class Tools:
    """A chat request's tools and what tool_choice makes of them."""
    functions: tuple[dict, ...]        # OpenAI function objects {name, description, parameters}
    choice: str                        # auto | required | named | none
    named: Optional[str] = None        # the function tool_choice names

    @property
    def in_prompt(self) -> bool:
        return self.choice != "none"

    def guided(self, parallel: bool = True) -> Optional[GuidedDecoding]:
        """The constraint tool_choice implies (auto and none: none)."""
        if self.choice == "named":
            fn = next(f for f in self.functions if f["name"] == self.named)
            return GuidedDecoding.json_schema(_parameters(fn))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {
                     "name": {"const": f["name"]}, "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for f in self.functions]
        return GuidedDecoding.json_schema({
            "type": "array", "minItems": 1, "maxItems": MAX_TOOL_CALLS if parallel else 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})

    def reply(self, text: str, finish: str) -> ToolReply:
        """What the reply `text`, ended for `finish` (stop | length), is: tool calls, content,
        or (constrained to calls, or an auto reply of calls cut by length) the calls it
        completed before it ended, never the cut call as content."""
        names = {f["name"] for f in self.functions}
        if self.choice == "named":
            if finish == "stop" and _complete_json(text):
                return ToolReply(None, (_call(self.named, text),), "tool_calls")
            return ToolReply(None, (), finish)
        if self.choice == "required":
            calls, closed = _array_calls(text, names)
            if closed and finish == "stop":
                return ToolReply(None, calls, "tool_calls")
            return ToolReply(None, calls, finish)
        tagged = _tagged_calls(text, names) if self.choice == "auto" else None
        if tagged is None or (finish == "stop" and not tagged[1]):
            return ToolReply(text, (), finish)
        calls, complete = tagged
        return ToolReply(None, calls, "tool_calls" if complete and finish == "stop" else finish)


def _parameters(fn: dict) -> Any:
    return strict_parameters(fn.get("parameters") or {"type": "object"})


def strict_parameters(schema: Any, close: bool = True) -> Any:
    """A function's parameters schema as strict function calling reads it: an object schema
    without additionalProperties (or patternProperties, unevaluatedProperties) takes
    additionalProperties false, and so do the schemas nested in it (properties, items, $defs,
    anyOf/oneOf branches). Combinators: a schema with anyOf/oneOf/allOf is left open (its
    branches say what it holds); anyOf/oneOf branches beside declared properties, and allOf
    branches, are left open too (closing one would forbid the others' properties)."""
    if isinstance(schema, list):
        return [strict_parameters(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_parameters(v) for k, v in out[key].items()}
    for key in ("items", "prefixItems", "additionalProperties"):
        if isinstance(out.get(key), (dict, list)):
            out[key] = strict_parameters(out[key])
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = strict_parameters(out[key], key != "allOf" and "properties" not in out)
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or \
        (kind is None and "properties" in out)
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties",
                 "anyOf", "oneOf", "allOf")
    if close and is_object and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def _complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _skip(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def _array_calls(text: str, names: set[str]) -> tuple[tuple[dict, ...], bool]:
    """(the complete calls, whether the array closed) of a `[{"name", "parameters"}, ...]`
    reply, read item by item with the JSON decoder: each character once."""
    calls: list[dict] = []
    i = _skip(text, 0)
    if not text.startswith("[", i):
        return (), False
    i += 1
    while True:
        try:
            item, i = _DECODER.raw_decode(text, _skip(text, i))
        except (ValueError, RecursionError):       # cut inside this call
            return tuple(calls), False
        call = _call_of(item, names, "parameters")
        if call is None:
            return tuple(calls), False
        calls.append(call)
        i = _skip(text, i)
        if not text.startswith(",", i):
            closed = text.startswith("]", i) and _skip(text, i + 1) == len(text)
            return tuple(calls), closed
        i += 1


def _tagged_calls(text: str, names: set[str]) -> Optional[tuple[tuple[dict, ...], bool]]:
    """(the complete calls, whether every block closed) of a reply made only of
    <tool_call>...</tool_call> blocks naming known tools (the last may be cut off), or None
    when it is content. Linear: one `find` per block, one decode per body."""
    if len(text) > MAX_TOOL_REPLY_CHARS:
        return None
    calls: list[dict] = []
    i = _skip(text, 0)
    while i < len(text):
        if not text.startswith(_OPEN, i):
            rest = text[i:]        # a reply cut inside the opening tag is a call cut off
            return (tuple(calls), False) if len(rest) < len(_OPEN) and \
                _OPEN.startswith(rest) else None
        start = i + len(_OPEN)
        end = text.find(_CLOSE, start)
        if end < 0:
            return tuple(calls), False
        try:
            body = json.loads(text[start:end])
        except (ValueError, RecursionError):
            return None
        call = _call_of(body, names, "arguments", "parameters")
        if call is None or len(calls) == MAX_TOOL_CALLS:
            return None
        calls.append(call)
        i = _skip(text, end + len(_CLOSE))
    return (tuple(calls), True) if calls else None


def _call_of(obj: Any, names: set[str], *arg_keys: str) -> Optional[dict]:
    """The OpenAI tool call of a decoded {"name", <arguments>} object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
            or obj["name"] not in names:
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return _call(obj["name"], json.dumps(args, ensure_ascii=False))


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tools(tools: Any, tool_choice: Any) -> Optional[Tools]:
    """Validate `tools` and `tool_choice` -> Tools, or None without tools. Raises ToolError."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {type: function, function: {...}}", "tools")
    fns = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" \
                or not isinstance(t.get("function"), dict):
            raise ToolError(f"{where}: only {{\"type\": \"function\", \"function\": {{...}}}} "
                            "tools are supported", where)
        fn = t["function"]
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolError(f"{where}.function: unknown field {sorted(unknown)[0]!r}", where)
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}",
                                                                   fn["name"]):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, _ . -",
                            f"{where}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object",
                            f"{where}.function.parameters")
        if _deeper_than(params, MAX_PARAMETERS_DEPTH):
            raise ToolError(f"{where}.function.parameters nests deeper than "
                            f"{MAX_PARAMETERS_DEPTH} levels", f"{where}.function.parameters")
        fns.append({k: fn[k] for k in ("name", "description", "parameters") if k in fn})
    names = [f["name"] for f in fns]
    if len(set(names)) != len(names):
        raise ToolError("tools: two functions have the same name", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else None
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools "
                            f"({', '.join(names)})", "tool_choice")
        return Tools(tuple(fns), "named", name)
    if choice not in ("auto", "required", "none"):
        raise ToolError(f"tool_choice {choice!r}: auto, required, none or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return Tools(tuple(fns), choice)


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether the JSON value `obj` nests more than `limit` levels (walked without recursion)."""
    stack = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def render_messages(messages: list[dict], tools: Optional[Tools], template: str
                    ) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for the chat template: tools as the template's
    `tools` when it reads them, else in a system message (the generic fallback). Assistant
    tool calls and tool results become text in the same <tool_call>/<tool_response> form."""
    native = "tools" in template
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls and not native:
            text = "\n".join("<tool_call>\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": _args(c["function"])},
                ensure_ascii=False) + "\n</tool_call>" for c in calls)
            m["content"] = (m.get("content") or "") + text
        elif calls:
            m["tool_calls"] = [{**c, "function": {**c["function"],
                                                  "arguments": _args(c["function"])}}
                               for c in calls]
        if m["role"] == "tool" and not native:
            m = {"role": "user",
                 "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools is None or not tools.in_prompt:
        return out, {}
    if native:
        return out, {"tools": [{"type": "function", "function": f} for f in tools.functions]}
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                        for f in tools.functions)
    prompt = TOOL_PROMPT.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _args(fn: dict) -> Any:
    a = fn.get("arguments")
    try:
        return json.loads(a) if isinstance(a, str) else a
    except (ValueError, RecursionError):     # not JSON, or nested too deeply: the text
        return a

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
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


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
            return GuidedDecoding.json_schema(fn.get("parameters") or {"type": "object"})
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {
                     "name": {"const": f["name"]},
                     "parameters": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for f in self.functions]
        schema = {"type": "array", "minItems": 1,
                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return GuidedDecoding.json_schema(schema)

    def calls(self, text: str) -> Optional[list[dict]]:
        """The OpenAI tool_calls a finished reply makes, or None (the reply is content)."""
        try:
            if self.choice == "named":
                json.loads(text)
                return [_call(self.named, text)]
            if self.choice == "required":
                return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                        for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return None
        if self.choice != "auto" or not _CALL.search(text) or _CALL.sub("", text).strip():
            return None
        names = {f["name"] for f in self.functions}
        out = []
        for body in _CALL.findall(text):
            try:
                c = json.loads(body)
                args = c.get("arguments", c.get("parameters", {}))
                if c["name"] not in names or not isinstance(args, dict):
                    return None
            except (ValueError, TypeError, KeyError, AttributeError):
                return None
            out.append(_call(c["name"], json.dumps(args, ensure_ascii=False)))
        return out


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
    except ValueError:
        return a

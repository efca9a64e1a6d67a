"""Chat templates, rendered under resource limits.

A chat template is Jinja that comes with the model: data, not code Kiln trusts. It renders in
Jinja's immutable sandbox (no attribute escapes, no mutation of the caller's objects), and on
top of that every render has a budget (`TemplateLimits`):

    a string, list or number built on the way  > max_chars   refused before it is built when
                                                             its size is known in advance
                                                             ('a' * 10**10, 10**10**10,
                                                             '{:>9999999999}'), else at once
    chars and items built over the whole render > max_work   (a loop that doubles a string)
    loop iterations and calls (macros included) > max_steps  (nested loops, recursion)
    the rendered text                           > max_chars

A render over a limit, a template error and the template's own raise_exception all raise
ChatTemplateError (a ValueError: the request is refused as invalid, never a server error).
`vet_chat_template` renders a plan's template once on a sample conversation, so a template
that cannot render is refused when the plan is built rather than on the first request.
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Iterator, Optional

from jinja2 import nodes
from jinja2.visitor import NodeTransformer
from jinja2.exceptions import TemplateError
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template failed, refused the messages, or went over a TemplateLimits cap."""


@dataclass(frozen=True)
class TemplateLimits:
    """What one render of a chat template may build and run."""
    max_chars: int = 1 << 24       # the rendered text, and any one value built on the way
    max_work: int = 1 << 27        # chars (and 16 per list item) built over one render
    max_steps: int = 1 << 18       # loop iterations (and CALL_STEPS per call) over one render


ITEM_COST = 16          # a list/dict entry costs as much work as this many characters
CALL_STEPS = 16         # a call (a macro's above all) costs as much as this many iterations
MAX_FILTER_ARG = 4096   # numeric arguments of filters (indent, center, truncate, slice ...)
_WIDE_FORMAT = re.compile(r"[%:][^%}]{0,8}?\d{6}")   # a format width/precision >= 100000


class _Budget:
    """What one render has spent (held in a context variable while it runs)."""

    def __init__(self, limits: TemplateLimits):
        self.limits, self.work, self.steps = limits, 0, 0

    def refuse(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(f"the chat template went over a limit: {what}")

    def charge(self, value: Any, what: str = "a value") -> None:
        """Check and charge a value just built."""
        self.size(_cost(value), what)

    def size(self, n: int, what: str = "a value") -> None:
        """Check and charge `n` characters (items x ITEM_COST) about to be, or just, built."""
        if n > self.limits.max_chars:
            raise self.refuse(f"{what} of {n} characters/items (at most "
                              f"{self.limits.max_chars})")
        self.work += n
        if self.work > self.limits.max_work:
            raise self.refuse(f"more than {self.limits.max_work} characters built in one "
                              "render")

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.limits.max_steps:
            raise self.refuse(f"more than {self.limits.max_steps} loop iterations in one "
                              f"render (a call counts as {CALL_STEPS})")


_BUDGET: contextvars.ContextVar[Optional[_Budget]] = contextvars.ContextVar("kiln_template",
                                                                            default=None)


def _budget() -> _Budget:
    b = _BUDGET.get()
    if b is None:
        raise ChatTemplateError("a chat template is rendered only through render()")
    return b


def _cost(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple, dict, set)):
        return ITEM_COST * len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 8
    return 0


def bounded_iter(iterable: Iterable) -> Iterator:
    """Every `{% for %}` iterates through this: each item is a step of the render's budget."""
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


def bounded_concat(*parts: Any) -> str:
    """Jinja's `~` operator, its result charged to the budget before it is built."""
    texts = [p if isinstance(p, str) else str(p) for p in parts]
    _budget().size(sum(map(len, texts)), "a joined string")
    return "".join(texts)


class _Bounding(NodeTransformer):
    """Routes every for loop and `~` of a parsed template through the budget (by imported
    names, which a template cannot shadow)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Call(nodes.ImportedName(f"{__name__}.bounded_iter"), [node.iter], [],
                               None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Call(nodes.ImportedName(f"{__name__}.bounded_concat"), node.nodes, [],
                          None, None, lineno=node.lineno)


def _check_ints(budget: _Budget, args: Iterable, cap: int) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > cap:
            raise budget.refuse(f"an argument of {a} (at most {cap})")


def _check_format(budget: _Budget, fmt: str) -> None:
    """A format string (str.format, %, the format filter) with no huge width or precision."""
    if ("%" in fmt or "{" in fmt) and _WIDE_FORMAT.search(fmt):
        raise budget.refuse("a format width or precision of 100000 or more")


# filters whose result's size follows from their arguments: checked before they run
_LISTING = ("do_list", "do_batch", "do_slice")      # one item per character / element
_WIDENING = ("do_indent", "do_center")               # width per line


def _precheck_filter(budget: _Budget, name: str, value: Any, args: tuple) -> None:
    if name in _LISTING:
        budget.size(ITEM_COST * len(value) if hasattr(value, "__len__") else 0, "a list")
    elif name in _WIDENING:
        width = max([a if isinstance(a, int) else len(str(a)) for a in args] + [0])
        text = str(value)
        budget.size((text.count("\n") + 1) * width + len(text), "an indented text")
    elif name == "do_format" and isinstance(value, str):
        _check_format(budget, value)


def _bounded_filter(fn):
    """A filter whose numeric arguments are capped, whose result is charged, and whose
    result's size is checked before it runs where its arguments tell it."""
    skip = 2 if hasattr(fn, "jinja_pass_arg") else 1     # (context/env,) value

    @functools.wraps(fn)
    def run(*args, **kwargs):
        budget = _budget()
        params = args[skip:] + tuple(kwargs.values())
        _check_ints(budget, params, MAX_FILTER_ARG)
        if len(args) >= skip:
            _precheck_filter(budget, fn.__name__, args[skip - 1], params)
        out = fn(*args, **kwargs)
        budget.charge(out, "a filter's result")
        return out
    return run


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if op == "*":
            seq, k = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(k, int) and isinstance(seq, (str, list, tuple)):
                budget.size(_cost(seq) * max(k, 0), "a repeated string or list")
            elif isinstance(left, int) and isinstance(right, int):
                budget.size((left.bit_length() + right.bit_length()) // 8, "a number")
        elif (op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0
              and abs(left) > 1):
            budget.size(left.bit_length() * min(right, 1 << 40) // 8, "a number")
        elif op == "%" and isinstance(left, str):
            _check_format(budget, left)
            _check_ints(budget, right if isinstance(right, (tuple, list)) else [right],
                        budget.limits.max_chars)
        out = self.binop_table[op](left, right)
        budget.charge(out, "a value")
        return out

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        budget = _budget()
        budget.step(CALL_STEPS)
        _check_ints(budget, args + tuple(kwargs.values()), budget.limits.max_chars)
        if isinstance(__obj, LoopContext) and args:    # a recursive loop's next level
            args = (bounded_iter(args[0]),) + args[1:]
        out = super().call(__context, __obj, *args, **kwargs)
        budget.charge(out, "a call's result")
        return out

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(_budget(), obj)
        return super().getattr(obj, attribute)


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template; render() is thread-safe (each render has its own budget)."""

    def __init__(self, source: str, limits: TemplateLimits = TemplateLimits()):
        self.limits = limits
        env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                  extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.filters = {name: _bounded_filter(fn) for name, fn in env.filters.items()}
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(_Bounding().visit(env.parse(source)))
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None

    def render(self, **variables) -> str:
        """The rendered text. Raises ChatTemplateError."""
        budget = _Budget(self.limits)
        token = _BUDGET.set(budget)
        try:
            parts, size = [], 0
            for part in self._template.generate(**variables):
                size += len(part)
                if size > self.limits.max_chars:
                    raise budget.refuse(f"a rendered text of more than {self.limits.max_chars}"
                                        " characters")
                parts.append(part)
            return "".join(parts)
        except ChatTemplateError:
            raise
        except TemplateError as e:    # the template's raise_exception, or a rendering error
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
        except (RecursionError, MemoryError, OverflowError) as e:
            raise budget.refuse(f"{type(e).__name__}: {e}") from None
        except Exception as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") \
                from None
        finally:
            _BUDGET.reset(token)


SAMPLE_CONVERSATION = (
    {"role": "user", "content": "Hello! What can you do?"},
    {"role": "assistant", "content": "I can answer questions."},
    {"role": "user", "content": "What is 2 + 2?"},
)


def vet_chat_template(source: str, bos_token: str = "", eos_token: str = "",
                      limits: TemplateLimits = TemplateLimits()) -> str:
    """Compile `source` and render it on SAMPLE_CONVERSATION -> the text. Raises
    ChatTemplateError naming the problem (a template that fails or goes over a limit)."""
    return ChatTemplate(source, limits).render(
        messages=[dict(m) for m in SAMPLE_CONVERSATION], bos_token=bos_token,
        eos_token=eos_token, add_generation_prompt=True)

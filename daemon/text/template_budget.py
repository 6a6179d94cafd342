"""A jinja sandbox whose renders run under a budget of CPU time and characters that template
code cannot escape.

Every place a template can spend time or build data passes a meter: each loop iteration, call,
filter, operator, slice, `~` concatenation, list or dict literal, output value and joined
buffer. Time is the rendering thread's CPU time. Characters (list and dict entries count one
each) are charged as they are built, cumulatively; operations that multiply sizes (`*`, `**`,
`+`, `%`, str.format widths, padding, joining, replacing, indenting, tojson's indent, sum) are
estimated first and refused before anything is allocated. Values are measured deep (a list
holding one string a thousand times weighs a thousand strings), so no value can be larger
than what was charged for it and no single comparison, sort or conversion can take long."""

from __future__ import annotations

import inspect
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import update_wrapper
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import LoopContext, Macro, Undefined
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
)
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from cpud.settings.errors import CpudError
from cpud.text.template_sizes import (
    BUFFERS,
    TEXT_FACTOR,
    TEXT_FILTERS,
    URLIZE_FACTOR,
    FilterEstimates,
    len_text,
    percent_size,
    positive,
    replace_size,
    size,
    spec_digits,
    text_size,
)

INT_BITS = 1 << 16  # integers a template may build (about 20 000 decimal digits)
CLOCK_EVERY = 64  # meter ticks between two reads of the thread's CPU clock
# Builtin methods whose result is already held elsewhere (nothing new to charge).
_HANDS_BACK = frozenset({"get", "setdefault", "pop", "keys", "values", "items", "copy"})
_SCOPES = ("_loop_vars", "_block_vars")  # what the generated code passes along with calls


class TemplateBudgetError(CpudError):
    """A render went past its budget; not a ValueError, so no filter swallows it."""


@dataclass(frozen=True)
class RenderBudget:
    """What one render of a chat template may spend: CPU seconds of its thread, and characters
    built (a base, plus a multiple of the characters of the conversation it was given)."""

    seconds: float = 1.0
    seconds_per_message: float = 0.001
    chars: int = 1 << 20
    per_input_char: int = 16

    def describe(self) -> str:
        return (
            f"{self.seconds:g} s of CPU plus {self.seconds_per_message * 1000:g} ms per message, "
            f"{self.chars} characters plus {self.per_input_char} per character of the "
            "conversation"
        )


class Meter:
    """One render's spending; raises TemplateBudgetError when past the budget."""

    def __init__(self, budget: RenderBudget, input_chars: int, messages: int):
        self.budget = budget
        self.limit = budget.chars + budget.per_input_char * input_chars
        self.left = self.limit
        self.seconds = budget.seconds + budget.seconds_per_message * messages
        self.deadline = time.thread_time() + self.seconds
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % CLOCK_EVERY == 0:
            self.check_time()

    def check_time(self) -> None:
        if time.thread_time() > self.deadline:
            raise TemplateBudgetError(f"it needed more than {self.seconds:g} s of CPU")

    def need(self, chars: int) -> None:
        """Refuse, before it is built, something of `chars` that would not fit."""
        if chars > self.left:
            raise TemplateBudgetError(
                f"it would build more than the {self.limit} characters it may for this conversation"
            )
        if chars > CLOCK_EVERY << 10:
            self.check_time()

    def charge(self, chars: int) -> None:
        self.need(chars)
        self.left -= chars


def _bound(sig: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return {}  # the filter itself will say what is wrong with its arguments
    bound.apply_defaults()
    return bound.arguments


class _Guards(NodeTransformer):
    """Rewrites a parsed template so that loops, `~` and literals pass the meter (as calls of
    environment attributes, which template code can neither name nor replace)."""

    @staticmethod
    def _wrap(name: str, *args: nodes.Expr, lineno: int) -> nodes.Call:
        call = nodes.Call(nodes.EnvironmentAttribute(name), list(args), [], None, None)
        return call.set_lineno(lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._wrap("guard_iter", node.iter, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return self._wrap("guard_concat", *node.nodes, lineno=node.lineno)

    def _literal(self, node: nodes.Expr) -> nodes.Node:
        self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":
            return node
        return self._wrap("guard_literal", node, lineno=node.lineno)

    visit_List = visit_Tuple = visit_Dict = _literal


class _GuardedCodeGenerator(CodeGenerator):
    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        _Guards().visit(node)
        super().visit_Template(node, frame)


class _BudgetFormatter(SandboxedFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        meter = self._env.meter()  # type: ignore[attr-defined]
        meter.need(text_size(value, meter.left) + spec_digits(format_spec))
        return super().format_field(value, format_spec)


class _BudgetEscapeFormatter(_BudgetFormatter, SandboxedEscapeFormatter):
    pass


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox with every hook metered; render() runs a template under a
    RenderBudget."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.globals.pop("lipsum", None)  # n paragraphs of lorem ipsum: nothing a chat needs
        self._local = threading.local()
        self.guard_iter = self._guard_iter
        self.guard_concat = self._guard_concat
        self.guard_literal = self._guard_literal
        self._guards = (self.guard_iter, self.guard_concat, self.guard_literal)
        self.finalize = self._finalize
        self.concat = self._concat  # type: ignore[method-assign]

    def meter(self) -> Meter:
        meter = getattr(self._local, "meter", None)
        if meter is None:  # compile-time constant folding: left to the render
            raise TemplateBudgetError("not rendering")
        return meter

    def meter_filters(self) -> None:
        """Wrap every filter (call once the filters are all registered)."""
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._metered_filter(name, fn)

    def render(self, compile: Callable[[], Any], context: dict, budget: RenderBudget) -> str:
        """compile() -> jinja2.Template, then its render with `context`, under `budget`
        (the conversation's weight is what `context` holds)."""
        messages = context.get("messages")
        count = len(messages) if isinstance(messages, list) else 0
        meter = Meter(budget, size(context, budget.chars << 8), count)
        self._local.meter = meter
        try:
            template = compile()
            out = []
            for chunk in template.root_render_func(template.new_context(context)):
                meter.tick()
                meter.charge(len(chunk))
                out.append(chunk)
            return "".join(out)
        finally:
            self._local.meter = None

    # -- hooks the sandbox calls ------------------------------------------------------------

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        meter = self.meter()
        meter.tick()
        if any(obj is guard for guard in self._guards):
            return obj(*args)  # (the generated code adds its loop and block variables)
        if isinstance(obj, LoopContext) and args:  # a recursive loop's next level
            args = (self._guard_iter(args[0]), *args[1:])
        owner = getattr(obj, "__self__", None)
        method = isinstance(obj, types.BuiltinMethodType) and owner is not None
        if method:
            args = self._method_estimate(meter, obj, owner, args, kwargs)
        result = SandboxedEnvironment.call(self, context, obj, *args, **kwargs)
        if isinstance(obj, Macro) or (method and obj.__name__ in _HANDS_BACK):
            return result
        if not isinstance(result, (Iterator, Undefined)):
            meter.charge(size(result, meter.left))
        return result

    def _method_estimate(
        self, meter: Meter, fn: Any, owner: Any, args: tuple, kwargs: dict
    ) -> tuple:
        """Refuse a builtin method call that would build too much; returns its arguments
        (a lazy iterable given to str.join materialized)."""
        name = fn.__name__
        own = len(owner) if isinstance(owner, BUFFERS) else 0
        if isinstance(owner, BUFFERS) and name == "join" and args:
            items = list(args[0])
            args = (items, *args[1:])
            estimate = own * len(items) + sum(text_size(i, meter.left) for i in items)
        elif isinstance(owner, BUFFERS) and name == "replace" and len(args) >= 2:
            count = args[2] if len(args) > 2 else kwargs.get("count", -1)
            estimate = replace_size(str(owner), args[0], args[1], count)
        elif isinstance(owner, BUFFERS) and name == "expandtabs":
            estimate = own * positive(args[0] if args else kwargs.get("tabsize", 8), 1)
        elif isinstance(owner, BUFFERS) and name == "translate" and args:
            table = args[0]
            longest = (
                max((len_text(v) for v in table.values()), default=1)
                if isinstance(table, dict)
                else 1
            )
            estimate = own * max(longest, 1)
        else:
            values = [*args, *(v for k, v in kwargs.items() if k not in _SCOPES)]
            estimate = 4 * own + sum(positive(v) for v in values if not isinstance(v, bool))
            estimate += sum(len(v) for v in values if isinstance(v, BUFFERS))
        meter.need(estimate)
        return args

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        meter = self.meter()
        meter.tick()
        estimate = self._binop_estimate(meter, operator, left, right)
        meter.need(estimate)
        result = self.binop_table[operator](left, right)
        if operator == "%" and isinstance(result, BUFFERS):
            meter.charge(len(result))
        else:
            meter.charge(estimate)
        return result

    @staticmethod
    def _binop_estimate(meter: Meter, operator: str, left: Any, right: Any) -> int:
        ints = isinstance(left, int) and isinstance(right, int)
        if ints and operator in ("*", "**"):
            bits = left.bit_length() + right.bit_length()
            if operator == "**":
                bits = max(left.bit_length(), 1) * right if right > 0 else 0
            if bits > INT_BITS:
                raise TemplateBudgetError(f"it would build a number of more than {INT_BITS} bits")
            return 0
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(times, int) and not isinstance(seq, int):
                unit = len(seq) if isinstance(seq, BUFFERS) else size(seq, meter.left)
                return unit * max(times, 0)
        if operator == "+" and not isinstance(left, (int, float)):
            scale = 6 if isinstance(left, Markup) or isinstance(right, Markup) else 1
            return scale * (size(left, meter.left) + size(right, meter.left))
        if operator == "%" and isinstance(left, BUFFERS):
            return percent_size(left, right, meter.left)
        return 0

    def getitem(self, obj: Any, argument: Any) -> Any:
        result = super().getitem(obj, argument)
        if isinstance(argument, slice) and isinstance(result, (*BUFFERS, list, tuple)):
            meter = self.meter()
            meter.tick()
            meter.charge(len(result))
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """The sandbox's str.format / format_map, with every field's width metered."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or (
            value.__name__ not in ("format", "format_map")
        ):
            return None
        owner = value.__self__
        if not isinstance(owner, str):
            return None
        formatter: SandboxedFormatter
        if isinstance(owner, Markup):
            formatter = _BudgetEscapeFormatter(self, escape=owner.escape)
        else:
            formatter = _BudgetFormatter(self)
        is_map = value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one mapping argument")
                args, kwargs = (), args[0]
            return type(owner)(formatter.vformat(owner, args, kwargs))

        return update_wrapper(wrapper, value)

    # -- the generated code's guards ----------------------------------------------------------

    def _guard_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        meter = self.meter()
        for item in iterable:
            meter.tick()
            yield item

    def _guard_concat(self, *parts: Any) -> str:
        meter = self.meter()
        meter.need(sum(text_size(p, meter.left) for p in parts))
        text = "".join([str(p) for p in parts])
        meter.charge(len(text))
        return text

    def _guard_literal(self, value: Any) -> Any:
        meter = self.meter()
        meter.charge(size(value, meter.left))
        return value

    def _finalize(self, value: Any) -> Any:
        meter = getattr(self._local, "meter", None)
        if meter is not None and not isinstance(value, (str, Undefined)):
            meter.need(text_size(value, meter.left))
        return value

    def _concat(self, pieces: Iterable[str]) -> str:
        pieces = pieces if isinstance(pieces, list) else list(pieces)
        meter = getattr(self._local, "meter", None)
        if meter is not None:
            meter.charge(sum(map(len, pieces)))
        return "".join(pieces)

    def _metered_filter(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        estimate = getattr(FilterEstimates, name, None)
        factor = URLIZE_FACTOR if name == "urlize" else TEXT_FACTOR
        text = name in TEXT_FILTERS or name == "urlize"
        skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0
        sig = inspect.signature(fn) if estimate is not None else None

        def metered(*args: Any, **kwargs: Any) -> Any:
            meter = self.meter()
            meter.tick()
            if sig is not None:
                bound = _bound(sig, args, kwargs)
                if bound:
                    meter.need(estimate(bound, meter.left))
                    args, kwargs = _rebind(sig, bound)
            elif text and len(args) > skip:
                meter.need(factor * size(args[skip], meter.left))
            result = fn(*args, **kwargs)
            if len(args) > skip and result is args[skip]:
                return result
            if not isinstance(result, (Iterator, Undefined)):
                meter.charge(size(result, meter.left))
            return result

        return update_wrapper(metered, fn)


def _rebind(sig: inspect.Signature, arguments: dict[str, Any]) -> tuple[tuple, dict]:
    """Positional and keyword arguments again from bound ones (after an estimate replaced a
    lazy iterable by its list)."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for param in sig.parameters.values():
        if param.name not in arguments:
            continue
        value = arguments[param.name]
        if param.kind is param.VAR_POSITIONAL:
            args.extend(value)
        elif param.kind is param.VAR_KEYWORD:
            kwargs.update(value)
        elif param.kind is param.KEYWORD_ONLY:
            kwargs[param.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs

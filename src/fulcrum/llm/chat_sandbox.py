"""The Jinja sandbox chat templates render in: transformers' environment (immutable sandbox,
trim_blocks, lstrip_blocks, loopcontrols, an unescaped tojson, raise_exception, strftime_now,
guarded namespace) plus bounds a hostile template cannot pass: every string or list it builds
stays under MAX_VALUE_CHARS, and a render may be given a deadline."""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from types import FrameType
from typing import Any, NoReturn

import jinja2
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import loopcontrols
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# Larger than any prompt a model takes (max_prompt_bytes is 1 MiB by default), far below memory.
MAX_VALUE_CHARS = 4 * 1024 * 1024
MAX_EXPONENT = 256  # `2 ** 10 ** 9` would spin in C, where no deadline can interrupt it
_DIGITS = re.compile(r"\d+")


class TemplateError(Exception):
    """A template raised, broke the sandbox's rules or went over a bound; the message says which."""


class _OverBudget(BaseException):
    """Raised from the trace hook past the deadline; a BaseException, so no `except Exception`
    inside Jinja's runtime can swallow it."""


def _weight(value: object, depth: int = 0) -> int:
    """About how many characters `value` becomes as text (shared references counted each time)."""
    if isinstance(value, str):
        return len(value)
    if depth < 4 and isinstance(value, list | tuple):
        return len(value) + sum(_weight(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return len(value) + sum(
            _weight(k, depth + 1) + _weight(v, depth + 1) for k, v in value.items()
        )
    return 1


def _check(value: object, what: str) -> None:
    if _weight(value) > MAX_VALUE_CHARS:
        raise TemplateError(f"{what} would exceed {MAX_VALUE_CHARS} characters")


def _check_numbers(args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> None:
    """A width, count or indent past the bound (`center(10**9)`, `'{:>99999999}'`) is refused
    before the call allocates it."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and abs(arg) > MAX_VALUE_CHARS:
            raise TemplateError(f"{what}: argument {arg} is too large")
        if isinstance(arg, str) and any(
            len(d) > 7 or int(d) > MAX_VALUE_CHARS for d in _DIGITS.findall(arg)
        ):
            raise TemplateError(f"{what}: a width in the format string is too large")


def _check_replace(text: str, old: str, new: str) -> None:
    growth = max(0, len(new) - len(old))
    if (
        growth
        and len(text) + (text.count(old) if old else len(text) + 1) * growth > MAX_VALUE_CHARS
    ):
        raise TemplateError(f"replace would exceed {MAX_VALUE_CHARS} characters")


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps jinja_pass_arg (pass_context and friends)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_numbers(args, kwargs, f"filter {name}")
        if name == "replace" and len(args) >= 3 and isinstance(args[-3], str):
            _check_replace(str(args[-3]), str(args[-2]), str(args[-1]))
        result = fn(*args, **kwargs)
        _check(result, f"filter {name}")
        return result

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` goes through the environment, so its result is bounded like `+`."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _TemplateDict:
    """`dict(...)` for templates without the type itself (its class attributes), as in
    transformers."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


class _GuardedNamespace(Namespace):
    """transformers' rule: a namespace stores no underscore-prefixed attribute."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature trick: `self=` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name, value in attrs.items():
            _GuardedNamespace._check_item(name, value)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _GuardedNamespace._check_item(name, value)
        super().__setitem__(name, value)

    @staticmethod
    def _check_item(name: object, value: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateError(f"a namespace cannot store {name!r}")
        _check(value, "namespace attribute")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with size bounds on everything a template builds."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            namespace=_GuardedNamespace,
            dict=_TemplateDict(),
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise TemplateError(f"exponent {right} is too large")
        if operator == "*":
            count, seq = (right, left) if isinstance(right, int) else (left, right)
            repeated = isinstance(count, int) and isinstance(seq, str | list | tuple)
            if repeated and _weight(seq) * max(count, 0) > MAX_VALUE_CHARS:
                raise TemplateError(f"repetition would exceed {MAX_VALUE_CHARS} characters")
        if operator == "%" and isinstance(left, str):
            _check_numbers((left,), {}, "% formatting")
        if operator == "+" and _weight(left) + _weight(right) > MAX_VALUE_CHARS:
            raise TemplateError(f"+ would exceed {MAX_VALUE_CHARS} characters")
        result = super().call_binop(context, operator, left, right)
        _check(result, f"operator {operator}")
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        """Method and function calls: `'x'.center(10**9)`, `s.replace(...)`."""
        _check_numbers(args, kwargs, "call")
        target = getattr(__obj, "__self__", None)
        if getattr(__obj, "__name__", None) == "replace" and isinstance(target, str) and args[1:]:
            _check_replace(target, str(args[0]), str(args[1]))
        result = super().call(__context, __obj, *args, **kwargs)
        _check(result, "call")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`'{:>99999999}'.format(x)`: the format string is checked when the method is looked up."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_numbers((value.__self__,), {}, "format")
        return wrapped

    def bounded_concat(self, parts: tuple[Any, ...]) -> str:
        if sum(_weight(p) for p in parts) > MAX_VALUE_CHARS:
            raise TemplateError(f"~ would exceed {MAX_VALUE_CHARS} characters")
        return "".join(str(p) for p in parts)


def render_bounded(
    template: jinja2.Template, context: dict[str, Any], budget_s: float | None
) -> str:
    """Render, stopping with TemplateError past `budget_s` seconds or MAX_VALUE_CHARS of
    output. The deadline is checked on every line the template runs (a trace hook on this
    thread only, removed again after)."""
    pieces: list[str] = []
    size = 0
    previous = sys.gettrace()
    if budget_s is not None:
        sys.settrace(_deadline_tracer(time.perf_counter() + budget_s))
    try:
        for piece in _generate(template, context):
            size += len(piece)
            if size > MAX_VALUE_CHARS:
                raise TemplateError(f"output exceeds {MAX_VALUE_CHARS} characters")
            pieces.append(piece)
    except _OverBudget:
        raise TemplateError(f"rendering took longer than {budget_s} s") from None
    except RecursionError:
        raise TemplateError("recursion too deep") from None
    except jinja2.TemplateError as exc:  # SecurityError included
        raise TemplateError(str(exc)) from exc
    finally:
        if budget_s is not None:
            sys.settrace(previous)
    return "".join(pieces)


def _generate(template: jinja2.Template, context: dict[str, Any]) -> Iterator[str]:
    return template.generate(**context)


def _deadline_tracer(deadline_s: float) -> Callable[[FrameType, str, Any], Any]:
    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if time.perf_counter() > deadline_s:
            raise _OverBudget
        return trace

    return trace


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: Jinja's own escapes HTML characters, which changes prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)

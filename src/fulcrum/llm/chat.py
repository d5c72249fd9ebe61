"""Chat messages -> prompt text: the checkpoint's Jinja chat template (sandboxed) when it has one
and jinja2 is installed, else a plain role-tagged default."""

from __future__ import annotations

from typing import Any

from fulcrum.errors import InvalidInput

DEFAULT_TEMPLATE_NAME = "fulcrum-default"


def render_chat(
    messages: list[dict[str, str]],
    template: str | None,
    special_tokens: dict[str, str],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt for `messages` ({"role", "content"} dicts)."""
    if template is not None:
        rendered = _render_jinja(messages, template, special_tokens, add_generation_prompt)
        if rendered is not None:
            return rendered
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    return "\n".join(lines)


def _render_jinja(
    messages: list[dict[str, str]],
    template: str,
    special_tokens: dict[str, str],
    add_generation_prompt: bool,
) -> str | None:
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None

    def raise_exception(message: str) -> Any:
        raise InvalidInput(f"chat template: {message}")

    # Sandboxed: a template comes with a downloaded checkpoint and must not run arbitrary code.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except (TemplateError, TypeError, ValueError) as exc:
        raise InvalidInput(f"chat template failed: {exc}") from exc

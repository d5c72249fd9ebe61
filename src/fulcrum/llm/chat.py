"""Chat messages -> prompt text: the checkpoint's Jinja chat template (sandboxed, compiled once per
model at load) when it has one and jinja2 is installed, else a plain role-tagged default."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from fulcrum.errors import ConfigError, InvalidInput

if TYPE_CHECKING:
    from jinja2 import Template

DEFAULT_TEMPLATE_NAME = "fulcrum-default"


def _raise_exception(message: str) -> NoReturn:
    raise InvalidInput(f"chat template: {message}")


def _compile(template: str) -> Template | None:
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    # Sandboxed: a template comes with a downloaded checkpoint and must not run arbitrary code.
    # The options and extension are transformers' own, so templates render as they do there.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ConfigError(f"tokenizer_config.json: chat_template does not compile: {exc}") from exc


class ChatTemplate:
    """One model's chat template, compiled once; `render` runs per request."""

    def __init__(self, template: str | None, special_tokens: dict[str, str]) -> None:
        self._compiled = _compile(template) if template is not None else None
        self._special_tokens = dict(special_tokens)

    @property
    def is_default(self) -> bool:
        """True when the role-tagged default is used (no template, or no jinja2)."""
        return self._compiled is None

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` ({"role", "content"} dicts)."""
        if self._compiled is None:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            if add_generation_prompt:
                lines.append("assistant:")
            return "\n".join(lines)
        from jinja2 import TemplateError

        context: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            **self._special_tokens,
        }
        try:
            return self._compiled.render(**context)
        except (TemplateError, TypeError, ValueError) as exc:
            raise InvalidInput(f"chat template failed: {exc}") from exc

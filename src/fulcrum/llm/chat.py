"""Chat messages -> prompt text: the checkpoint's Jinja chat template (compiled once per model at
load) or a request's own, rendered as transformers' apply_chat_template does with vLLM's controls
(add_generation_prompt, continue_final_message, chat_template_kwargs, documents, tools); a plain
role-tagged default when there is no template or no jinja2."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fulcrum.errors import ConfigError, InvalidInput

if TYPE_CHECKING:
    from jinja2 import Template

DEFAULT_TEMPLATE_NAME = "fulcrum-default"
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024  # real templates are 1-20 KB
REQUEST_TEMPLATE_BUDGET_S = 1.0  # a request's template renders within this, or the request fails
# What the renderer itself passes: chat_template_kwargs may not replace these.
_RESERVED_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "documents", "tools"}
)
# transformers appends this to the final message and cuts the rendered text there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How one request wants its messages rendered (vLLM's chat request fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the final (assistant) message open to extend
    add_special_tokens: bool | None = None  # None: only when the template renders none itself
    chat_template: str | None = None  # the request's own template (trusted models only)
    chat_template_kwargs: Mapping[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # Function tools as transformers passes them: [{"type": "function", "function": {...}}]
    tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidInput(
                "continue_final_message: cannot be true together with add_generation_prompt "
                "(set add_generation_prompt to false)",
                param="continue_final_message",
            )
        reserved = _RESERVED_KWARGS.intersection(self.chat_template_kwargs or {})
        if reserved:
            raise InvalidInput(
                f"chat_template_kwargs: may not set {sorted(reserved)}; use the request fields",
                param="chat_template_kwargs",
            )

    @property
    def request_template(self) -> str | None:
        """The request's template: `chat_template`, or `chat_template_kwargs.chat_template`
        (vLLM reads both)."""
        if self.chat_template is not None:
            return self.chat_template
        value = (self.chat_template_kwargs or {}).get("chat_template")
        if value is not None and not isinstance(value, str):
            raise InvalidInput("chat_template_kwargs.chat_template: expected a string")
        return value

    def extra_texts(self) -> list[str]:
        """What the template may print besides the messages (documents, kwargs), so prompt size
        bounds and the off-loop decision count it too."""
        values = [
            *(self.documents or ()),
            *(self.chat_template_kwargs or {}).values(),
            *(self.tools or ()),
        ]
        return [v if isinstance(v, str) else str(v) for v in values]

    def template_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in (self.chat_template_kwargs or {}).items() if k != "chat_template"}


DEFAULT_OPTIONS = ChatOptions()


def _compile(template: str, *, what: str) -> Template | None:
    try:
        from jinja2 import TemplateError

        from fulcrum.llm.chat_sandbox import BoundedEnvironment
    except ImportError:
        return None
    # Sandboxed: a template comes with a downloaded checkpoint (or a request) and must not run
    # arbitrary code; the environment is transformers' own, so templates render as they do there.
    try:
        return BoundedEnvironment().from_string(template)
    except TemplateError as exc:
        if what == "checkpoint":
            raise ConfigError(
                f"tokenizer_config.json: chat_template does not compile: {exc}"
            ) from exc
        raise InvalidInput(f"chat_template: does not compile: {exc}") from exc


class ChatTemplate:
    """One model's chat template, compiled once; `render` runs per request. A request's own
    template is refused unless the model trusts request templates (vLLM's
    --trust-request-chat-template), and is bounded in size and render time even then."""

    def __init__(
        self,
        template: str | None,
        special_tokens: dict[str, str],
        *,
        trust_request_templates: bool = False,
    ) -> None:
        self._source = template
        self._compiled = _compile(template, what="checkpoint") if template is not None else None
        self._special_tokens = dict(special_tokens)
        self.trust_request_templates = trust_request_templates

    @property
    def is_default(self) -> bool:
        """True when the role-tagged default is used (no template, or no jinja2)."""
        return self._compiled is None

    def renders_special_tokens(self, options: ChatOptions = DEFAULT_OPTIONS) -> bool:
        """Whether the template used for `options` writes its own special tokens (BOS...)."""
        return not (self.is_default and options.request_template is None)

    def render(self, messages: list[dict[str, Any]], options: ChatOptions = DEFAULT_OPTIONS) -> str:
        """The prompt for `messages` ({"role", "content"} dicts; an assistant's `tool_calls`,
        a tool message's `tool_call_id`)."""
        source, compiled, budget_s = self._template_for(options)
        if compiled is None or source is None:
            return _render_default(messages, options)
        if options.tools and "tools" not in source:  # the model would never see them
            raise InvalidInput(
                "tools: the chat template does not render tools; use a tool-aware template",
                param="tools",
            )
        context: dict[str, Any] = {
            **self._special_tokens,
            **options.template_kwargs(),
            "messages": messages,
            "add_generation_prompt": options.add_generation_prompt,
            "documents": options.documents,
            "tools": options.tools,  # transformers passes it (None) even when there are none
        }
        if not options.continue_final_message:
            return _render(compiled, context, budget_s)
        return _render_continued(compiled, source, context, budget_s)

    def _template_for(
        self, options: ChatOptions
    ) -> tuple[str | None, Template | None, float | None]:
        requested = options.request_template
        if requested is None:
            return self._source, self._compiled, None
        if not self.trust_request_templates:
            raise InvalidInput(
                "chat_template: this model does not accept request chat templates (set "
                "trust_request_chat_template in its [parameters], as vLLM's "
                "--trust-request-chat-template)",
                param="chat_template",
            )
        if len(requested) > MAX_REQUEST_TEMPLATE_CHARS:
            raise InvalidInput(
                f"chat_template: longer than {MAX_REQUEST_TEMPLATE_CHARS} characters",
                param="chat_template",
            )
        compiled = _compile(requested, what="request")
        if compiled is None:
            raise InvalidInput("chat_template: jinja2 is not installed", param="chat_template")
        return requested, compiled, REQUEST_TEMPLATE_BUDGET_S


def _render(compiled: Template, context: dict[str, Any], budget_s: float | None) -> str:
    from fulcrum.llm.chat_sandbox import TemplateError, render_bounded

    # A request's own template (the one with a budget) is what a failure points at.
    param = "messages" if budget_s is None else "chat_template"
    try:
        return render_bounded(compiled, context, budget_s)
    except TemplateError as exc:
        raise InvalidInput(f"chat template: {exc}", param=param) from exc
    except (TypeError, ValueError, LookupError, AttributeError) as exc:
        raise InvalidInput(f"chat template failed: {exc}", param=param) from exc


def _render_continued(
    compiled: Template, source: str, context: dict[str, Any], budget_s: float | None
) -> str:
    """transformers' continue_final_message: tag the final message, render, cut at the tag."""
    messages = context["messages"]
    if not messages:
        raise InvalidInput("continue_final_message: there is no final message to continue")
    if "content" not in source:
        raise InvalidInput(
            "continue_final_message: the chat template does not render message content"
        )
    final = messages[-1]["content"]
    tagged = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
    rendered = _render(compiled, {**context, "messages": tagged}, budget_s)
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise InvalidInput(
            "continue_final_message: the chat template drops part of the final message"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the spacing after the message


def _render_default(messages: list[dict[str, Any]], options: ChatOptions) -> str:
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    # Tools and calls as JSON lines: the default drops nothing a request sent.
    if options.tools:
        lines.insert(0, f"tools: {json.dumps(options.tools, ensure_ascii=False)}")
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            lines[i + bool(options.tools)] += (
                f" tool_calls: {json.dumps(m['tool_calls'], ensure_ascii=False)}"
            )
    if options.add_generation_prompt:
        lines.append("assistant:")
    return "\n".join(lines)

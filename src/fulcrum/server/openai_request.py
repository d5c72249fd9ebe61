"""What a completions or chat body says besides sampling: the id it is answered under (vLLM's
`request_id`, or X-Request-Id) and how its messages are rendered (vLLM's chat-template fields)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fulcrum.context import MAX_LABEL_CHARS, REQUEST_ID_HEADER
from fulcrum.errors import InvalidInput
from fulcrum.llm.chat import ChatOptions
from fulcrum.llm.tools import ToolPlan, tool_plan

if TYPE_CHECKING:
    from starlette.requests import Request

    from fulcrum.context import RequestContext
    from fulcrum.protocol.openai import ChatCompletionRequest


def with_request_id(ctx: RequestContext, request: Request, body_id: str | None) -> RequestContext:
    """The context under the request's id: X-Request-Id when sent (it wins, as in vLLM), else
    the body's `request_id`, else the generated one. The endpoint echoes it in X-Request-Id;
    responses are `cmpl-<id>` / `chatcmpl-<id>`."""
    if body_id is not None and request.headers.get(REQUEST_ID_HEADER) is None:
        # It becomes a response header and a log field: bounded, printable ASCII, like the header.
        if not body_id or len(body_id) > MAX_LABEL_CHARS or not body_id.isascii():
            raise InvalidInput(
                f"request_id: 1 to {MAX_LABEL_CHARS} printable ASCII characters expected",
                param="request_id",
            )
        if not body_id.isprintable():
            raise InvalidInput("request_id: printable ASCII expected", param="request_id")
        ctx = dataclasses.replace(ctx, request_id=body_id)
    request.state.request_id = ctx.request_id
    return ctx


def chat_options(body: ChatCompletionRequest, plan: ToolPlan | None = None) -> ChatOptions:
    """The chat-template controls of a chat body (null: the field's default), its tools
    included (`plan`, checked here when not given). An absent add_generation_prompt is false
    when continue_final_message is asked; both true is a 400."""
    if plan is None:
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    continue_final = bool(body.continue_final_message)
    add_generation_prompt = body.add_generation_prompt
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final
    return ChatOptions(
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        add_special_tokens=body.add_special_tokens,  # null: only if the template adds none
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        documents=body.documents,
        tools=plan.template_tools,
    )

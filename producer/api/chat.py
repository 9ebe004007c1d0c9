"""Prompts of the OpenAI routes: the chat template, and completions' prompt forms.

Tools (``producer.api.tools``) go to a template that renders them (its source
mentions ``tools``); other templates get them described in the system
message, and an assistant's earlier calls as the JSON text the model was
asked to write. Tool results are ``tool`` messages, passed to the template
as they are (with their ``tool_call_id``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from producer.api.errors import bad_request
from producer.api.openai_types import ChatMessage
from producer.api.tools import ToolPlan, calls_text, template_calls

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name; chat templates know "system"


def template_messages(messages: list[ChatMessage], renders_tools: bool = False) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content only, parts joined by newlines (vLLM);
    an assistant's calls as the template takes them (``renders_tools``) or as text."""
    out: list[dict[str, Any]] = []
    for n, message in enumerate(messages):
        entry: dict[str, Any] = {"role": ROLE_ALIASES.get(message.role, message.role), "content": _text(n, message)}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls and renders_tools:
            entry["tool_calls"] = template_calls(message.tool_calls)
        elif message.tool_calls:
            entry["content"] = "\n".join(x for x in (entry["content"], calls_text(message.tool_calls)) if x)
        out.append(entry)
    return out


def content_chars(messages: list[ChatMessage]) -> int:
    """Characters of the messages' text content: the prompt holds them all, so its tokens are at least
    these over the longest a token stands for (``producer.api.submit.too_long``)."""
    return sum(
        len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or [])
        for m in messages
    )


def _text(n: int, message: ChatMessage) -> str:
    """Message ``n``'s content as text; 400 where OpenAI's API requires what is missing: content but
    for an assistant's calls, a text part's ``text``, a tool result's ``tool_call_id``."""
    param = f"messages.{n}"
    if message.role == "tool" and not message.tool_call_id:
        raise bad_request(
            f"{param}.tool_call_id: a tool message answers a call: name it", param=f"{param}.tool_call_id"
        )
    content = message.content
    if content is None and not (message.role == "assistant" and message.tool_calls):
        raise bad_request(f"{param}.content: required for a {message.role} message", param=f"{param}.content")
    if not isinstance(content, list):
        return content or ""
    other = next((part.type for part in content if part.type != "text"), None)
    if other is not None:
        raise bad_request(
            f"{param}.content: {other!r} parts are not supported; only text",
            param=f"{param}.content",
            code="unsupported_content",
        )
    missing = next((i for i, part in enumerate(content) if part.text is None), None)
    if missing is not None:
        raise bad_request(f"{param}.content.{missing}.text: a text part needs its text", param=f"{param}.content")
    return "\n".join(part.text or "" for part in content)


def with_tools_described(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The tools in the system message (prepended to one the conversation has, else a new first one)."""
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{plan.system_prompt()}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": plan.system_prompt()}, *messages]


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    result = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    if hasattr(result, "keys"):  # transformers 5 returns a BatchEncoding
        result = result["input_ids"]
    return list(result)


async def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Any, plan: ToolPlan | None = None) -> list[int]:
    """The prompt the model's chat template makes of ``messages`` (and the tools ``plan`` offers),
    ending with the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "the served model has no chat template; use /v1/completions", param="messages", code="no_chat_template"
        )
    renders_tools = "tools" in tokenizer.chat_template
    converted = template_messages(messages, renders_tools)
    tools = None
    if plan is not None and renders_tools:
        tools = [{"type": "function", "function": t.model_dump(exclude_none=True)} for t in plan.tools]
    elif plan is not None:
        converted = with_tools_described(converted, plan)
    try:
        ids = await asyncio.to_thread(_apply_template, tokenizer, converted, tools)
    except Exception as exc:  # jinja raises for conversations the template refuses (e.g. role order)
        raise bad_request(
            f"messages: the chat template refused them: {exc}", param="messages", code="chat_template_error"
        ) from None
    if not ids:
        raise bad_request("messages make an empty prompt", param="messages", code="empty_input")
    return ids


def completion_inputs(prompt: str | list, max_prompts: int) -> list[str | list[int]]:
    """The prompts, each as text or token ids: a string or one id list is one prompt; a list of
    strings or of id lists is several (each becomes a request of its own), at most ``max_prompts``."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > max_prompts:
        raise bad_request(
            f"prompt: a list of {len(prompt)} prompts is more than this server takes in one "
            f"request ({max_prompts}); split it",
            param="prompt",
            code="too_many_prompts",
        )
    return list(prompt)


def prompt_text(inputs: str | list[int], tokenizer: Any) -> str:
    """What ``echo`` prepends: the prompt as given, or its token ids decoded."""
    return inputs if isinstance(inputs, str) else tokenizer.decode(inputs, skip_special_tokens=True)

"""Prompts of the OpenAI routes: the chat template, and completions' prompt forms."""

from __future__ import annotations

import asyncio
from typing import Any

from producer.api.errors import bad_request
from producer.api.openai_types import ChatMessage

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name; chat templates know "system"


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as chat templates expect them: text content only, parts joined by newlines (vLLM)."""
    out = []
    for n, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            other = next((part.type for part in content if part.type != "text"), None)
            if other is not None:
                raise bad_request(
                    f"messages.{n}.content: {other!r} parts are not supported; only text",
                    param=f"messages.{n}.content",
                    code="unsupported_content",
                )
            content = "\n".join(part.text or "" for part in content)
        entry = {"role": ROLE_ALIASES.get(message.role, message.role), "content": content or ""}
        if message.name:
            entry["name"] = message.name
        out.append(entry)
    return out


def _apply_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    result = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(result, "keys"):  # transformers 5 returns a BatchEncoding
        result = result["input_ids"]
    return list(result)


async def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Any) -> list[int]:
    """The prompt the model's chat template makes of ``messages``, ending with the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "the served model has no chat template; use /v1/completions", param="messages", code="no_chat_template"
        )
    converted = template_messages(messages)
    try:
        ids = await asyncio.to_thread(_apply_template, tokenizer, converted)
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

"""OpenAI routes: every invalid parameter is a 400 naming it (404 for the model),
in OpenAI's error shape, before anything is written to Redis."""

from __future__ import annotations

import asyncio

import pytest

from tests.redis_keys import keys_with_prefix

MODEL = "SmolLM2-135M-Instruct.Q4_1"
MESSAGES = [{"role": "user", "content": "hi"}]
COMPLETION = {"model": MODEL, "prompt": "hi"}
CHAT = {"model": MODEL, "messages": MESSAGES}

COMMON = {  # bad field -> the name the message and ``param`` must carry
    "temperature": ({"temperature": 2.5}, "temperature"),
    "temperature_negative": ({"temperature": -0.1}, "temperature"),
    "top_p_zero": ({"top_p": 0}, "top_p"),
    "top_p_above_one": ({"top_p": 1.01}, "top_p"),
    "n": ({"n": 9}, "n"),
    "n_zero": ({"n": 0}, "n"),
    "max_tokens": ({"max_tokens": -1}, "max_tokens"),
    "presence_penalty": ({"presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty": ({"frequency_penalty": -2.5}, "frequency_penalty"),
    "repetition_penalty": ({"repetition_penalty": 0}, "repetition_penalty"),
    # 0 in float32: unreadable chunks, a 400 naming an internal field, streams cut (red team 5)
    "repetition_penalty_tiny": ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    "top_k": ({"top_k": -2}, "top_k"),
    "min_p": ({"min_p": 1.5}, "min_p"),
    "min_tokens": ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    "min_tokens_negative": ({"min_tokens": -1}, "min_tokens"),
    "stop_type": ({"stop": 5}, "stop"),
    "stop_too_many": ({"stop": [str(i) for i in range(11)]}, "stop"),
    "seed_type": ({"seed": "x"}, "seed"),
    "stream_type": ({"stream": "yes"}, "stream"),
    "stream_options_without_stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "logit_bias": ({"logit_bias": {"5": 10.0}}, "logit_bias"),
    "model_type": ({"model": 3}, "model"),
}
COMPLETION_ONLY = {
    "prompt_missing": ({"prompt": None}, "prompt"),
    "prompt_list_too_long": ({"prompt": ["a"] * 65}, "prompt"),
    "prompt_list_empty_item": ({"prompt": ["a", ""]}, "prompt.1"),
    "prompt_list_token_id": ({"prompt": [[1, 2], [3, 99999]]}, "prompt.1"),
    "prompt_empty": ({"prompt": ""}, "prompt"),
    "prompt_token_id": ({"prompt": [1, 99999]}, "prompt"),
    "logprobs_range": ({"logprobs": 6}, "logprobs"),
    "echo_logprobs_streamed": ({"echo": True, "logprobs": 0, "stream": True}, "stream"),
    "score_only_streamed": ({"max_tokens": 0, "stream": True}, "stream"),
    "suffix": ({"suffix": "end"}, "suffix"),
    "best_of": ({"best_of": 3}, "best_of"),
}
CHAT_ONLY = {
    "messages_empty": ({"messages": []}, "messages"),
    "messages_role": ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    "messages_image": ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    # what OpenAI requires and a red-team probe found taken as empty text (a 200)
    "messages_no_content": ({"messages": [{"role": "user"}]}, "messages.0.content"),
    "messages_null_content": ({"messages": [{"role": "system", "content": None}, *MESSAGES]}, "messages.0.content"),
    "messages_part_without_text": (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages.0.content",
    ),
    "messages_assistant_empty": ({"messages": [*MESSAGES, {"role": "assistant"}, *MESSAGES]}, "messages.1.content"),
    "messages_tool_without_id": (
        {"messages": [*MESSAGES, {"role": "tool", "content": "42"}]},
        "messages.1.tool_call_id",
    ),
    "top_logprobs_without_logprobs": ({"top_logprobs": 3}, "top_logprobs"),
    "top_logprobs_range": ({"top_logprobs": 21}, "top_logprobs"),
    "max_completion_tokens": ({"max_completion_tokens": 0}, "max_completion_tokens"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens"),  # completions take 0 (score only), chat does not
    "tool_choice_without_tools": ({"tool_choice": "auto"}, "tool_choice"),
    "tools_schema": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
        "tools.0.function.parameters",
    ),
    "legacy_functions": ({"functions": [{"name": "f"}]}, "functions"),
    "response_format": ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
}
CASES = [("/v1/completions", COMPLETION, name, *case) for name, case in {**COMMON, **COMPLETION_ONLY}.items()] + [
    ("/v1/chat/completions", CHAT, name, *case) for name, case in {**COMMON, **CHAT_ONLY}.items()
]


def openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    ("route", "base", "name", "change", "param"), CASES, ids=[f"{c[0].split('/')[-1]}-{c[2]}" for c in CASES]
)
async def test_bad_parameter_is_400_naming_it(client, rclient, redis_settings, route, base, name, change, param):
    body = {key: value for key, value in {**base, **change}.items() if value is not None}
    error = openai_error(await client.post(route, json=body), 400)
    assert error["param"] == param and param in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


@pytest.mark.parametrize("route,base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_unknown_model_is_404(client, rclient, redis_settings, route, base):
    error = openai_error(await client.post(route, json={**base, "model": "gpt-4o"}), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []
    assert openai_error(await client.get("/v1/models/gpt-4o"), 404)["code"] == "model_not_found"


async def test_too_long_names_both_numbers(client, tokenizer):
    text = "lorem ipsum dolor sit amet " * 400
    n = len(tokenizer.encode(text))
    error = openai_error(
        await client.post("/v1/completions", json={**COMPLETION, "prompt": text, "max_tokens": 30}), 400
    )
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"{n} in the prompt, 30 in the completion" in error["message"] and "2048 tokens" in error["message"]
    messages = [{"role": "user", "content": text}]
    error = openai_error(await client.post("/v1/chat/completions", json={**CHAT, "messages": messages}), 400)
    assert error["code"] == "context_length_exceeded" and "in the messages" in error["message"]


async def test_bad_json_and_template_errors(client):
    error = openai_error(await client.post("/v1/chat/completions", content=b"{nope"), 400)
    assert error["code"] == "json_invalid"
    error = openai_error(await client.post("/v1/completions", content=b""), 400)
    assert error["message"] == "request body is empty"


async def test_the_model_dir_name_is_accepted(client, worker):
    """``--model_dir default`` serves as "default" too, so quick-start commands work."""
    task = asyncio.create_task(client.post("/v1/completions", json={**COMPLETION, "model": "default"}))
    await worker.generate(await worker.take(), ["ok"], finish_reason="stop")
    assert (await task).json()["choices"][0]["text"] == "ok"

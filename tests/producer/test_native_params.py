"""Every LightLLM parameter on /generate and /generate_stream: forwarded to the
wire parameters, validated as LightLLM does (400 naming it), return_details."""

from __future__ import annotations

import asyncio

import pytest

from tests.redis_keys import keys_with_prefix

ROUTES = ["/generate", "/generate_stream", "/v1/requests"]
ALL = {
    "max_new_tokens": 20,
    "min_new_tokens": 3,
    "do_sample": True,
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 50,
    "min_p": 0.1,
    "ignore_eos": True,
    "seed": 42,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "repetition_penalty": 1.2,
    "stop_sequences": ["###", [198]],
    "best_of": 1,
    "n": 1,
    "return_details": False,
    "skip_special_tokens": True,
}


async def accepted(client, worker, route, parameters):
    """The request the route enqueued for ``parameters``."""
    task = asyncio.create_task(client.post(route, json={"inputs": "hello", "parameters": parameters}))
    request = await worker.take()
    await worker.generate(request, ["x"], finish_reason="stop")
    assert (await task).status_code in (200, 202)
    return request


@pytest.mark.parametrize("route", ROUTES)
async def test_every_parameter_reaches_the_worker(client, worker, tokenizer, route):
    params = (await accepted(client, worker, route, ALL)).params
    assert (params.max_new_tokens, params.min_new_tokens, params.do_sample) == (20, 3, True)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.8, 0.9, 50, 0.1)
    assert params.ignore_eos and params.seed == 42
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, 0.25, 1.2)
    assert params.stop_sequences == ("###", tokenizer.decode([198]))  # token ids decoded to text


async def test_stop_sequence_forms_and_defaults(client, worker):
    params = (await accepted(client, worker, "/generate", {"stop_sequences": "\n\n"})).params
    assert params.stop_sequences == ("\n\n",)
    params = (await accepted(client, worker, "/generate", {"stop_sequences": ["a", "", [], "a"]})).params
    assert params.stop_sequences == ("a",)  # empty ones dropped (LightLLM), repeats once
    params = (await accepted(client, worker, "/generate", {"seed": -1})).params
    assert params.seed is None and params.min_new_tokens == 0 and params.repetition_penalty == 1.0
    assert params.stop_sequences == () and params.presence_penalty == 0 and params.min_p == 0


BAD = {  # parameters -> the name the 400 must carry
    "presence_negative": ({"presence_penalty": -0.1}, "parameters.presence_penalty"),
    "frequency_negative": ({"frequency_penalty": -1}, "parameters.frequency_penalty"),
    "repetition_below_one": ({"repetition_penalty": 0.9}, "parameters.repetition_penalty"),
    # past float32 once times a count: the sampled row went NaN (token 0, a null logprob) with a 200
    "presence_huge": ({"presence_penalty": 1e300}, "parameters.presence_penalty"),
    "frequency_huge": ({"frequency_penalty": 1e39}, "parameters.frequency_penalty"),
    "repetition_huge": ({"repetition_penalty": 1e39}, "parameters.repetition_penalty"),
    # inf in float32: the sampled row NaN, EOS at index 0 past min_new_tokens (red team 5)
    "temperature_huge": ({"do_sample": True, "temperature": 1e39}, "parameters.temperature"),
    "min_new_zero": ({"min_new_tokens": 0}, "parameters.min_new_tokens"),
    "min_above_max": ({"min_new_tokens": 9, "max_new_tokens": 8}, "parameters.min_new_tokens"),
    "min_above_default_max": ({"min_new_tokens": 17}, "parameters.min_new_tokens"),
    "min_p_range": ({"min_p": 1.5}, "parameters.min_p"),
    "stop_too_many": ({"stop_sequences": [str(i) for i in range(11)]}, "parameters.stop_sequences"),
    "stop_bad_id": ({"stop_sequences": [[1, 99999]]}, "parameters.stop_sequences"),
    "stop_special_only": ({"stop_sequences": [[2]]}, "parameters.stop_sequences"),
    "stop_too_long": ({"stop_sequences": [[198] * 257]}, "parameters.stop_sequences"),
    "stop_type": ({"stop_sequences": 7}, "parameters.stop_sequences"),
    "best_of_range": ({"best_of": 9, "n": 9}, "parameters.best_of"),
    "n_not_best_of": ({"best_of": 2, "n": 1}, "parameters.n"),
    "n_alone": ({"n": 3}, "parameters.n"),
    "seed_float": ({"seed": 1.5}, "parameters.seed"),
    "return_details_type": ({"return_details": "yes"}, "parameters.return_details"),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", list(BAD))
async def test_invalid_parameter_is_400_naming_it(client, rclient, redis_settings, route, name):
    parameters, param = BAD[name]
    response = await client.post(route, json={"inputs": "hi", "parameters": parameters})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and param in error["message"], error
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


@pytest.mark.parametrize("route", ["/generate_stream", "/v1/requests"])
async def test_groups_only_on_generate(client, rclient, redis_settings, route):
    response = await client.post(route, json={"inputs": "hi", "parameters": {"n": 2, "best_of": 2}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "parameters.best_of"
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


async def test_return_details_lists_every_token(client, worker):
    task = asyncio.create_task(client.post("/generate", json={"inputs": "hi", "parameters": {"return_details": True}}))
    await worker.generate(await worker.take(), ["Hel", "lo"], finish_reason="stop")
    body = (await task).json()
    assert body["generated_text"] == ["Hello"] and body["count_output_tokens"] == 2
    assert body["tokens"] == [{"id": 100, "text": "Hel", "logprob": -0.25}, {"id": 101, "text": "lo", "logprob": -0.25}]

    task = asyncio.create_task(client.post("/generate", json={"inputs": "hi"}))
    await worker.generate(await worker.take(), ["x"], finish_reason="stop")
    assert "tokens" not in (await task).json()  # LightLLM's shape without return_details

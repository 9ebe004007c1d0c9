"""Bad input: a 4xx in OpenAI's error shape before anything is written to Redis."""

from __future__ import annotations

import pytest

from tests.redis_keys import keys_with_prefix

ROUTES = ["/generate", "/generate_stream", "/v1/requests"]

BAD_JSON_BODIES = {
    "empty_body": b"",
    "whitespace_body": b"  \n",
    "invalid_json": b'{"inputs": "hi",',
    "not_json": b"inputs=hi",
}
BAD_BODIES = {
    "list_body": [1, 2],
    "no_inputs": {"parameters": {"max_new_tokens": 4}},
    "inputs_number": {"inputs": 123},
    "inputs_mixed_list": {"inputs": [1, "a"]},
    "inputs_bool_ids": {"inputs": [1, True]},
    "inputs_empty_text": {"inputs": ""},
    "inputs_empty_ids": {"inputs": []},
    "id_too_large": {"inputs": [1, 49152]},
    "id_negative": {"inputs": [-1]},
    "parameters_string": {"inputs": "hi", "parameters": "fast"},
    "max_new_tokens_negative": {"inputs": "hi", "parameters": {"max_new_tokens": -5}},
    "max_new_tokens_zero": {"inputs": "hi", "parameters": {"max_new_tokens": 0}},
    "max_new_tokens_string": {"inputs": "hi", "parameters": {"max_new_tokens": "5"}},
    "max_new_tokens_float": {"inputs": "hi", "parameters": {"max_new_tokens": 2.5}},
    "temperature_negative": {"inputs": "hi", "parameters": {"temperature": -0.5}},
    "temperature_string": {"inputs": "hi", "parameters": {"temperature": "hot"}},
    "top_p_zero": {"inputs": "hi", "parameters": {"top_p": 0}},
    "top_p_above_one": {"inputs": "hi", "parameters": {"top_p": 1.5}},
    "top_k_below_minus_one": {"inputs": "hi", "parameters": {"top_k": -2}},
    "do_sample_string": {"inputs": "hi", "parameters": {"do_sample": "yes"}},
}


def assert_openai_error(response, status=(400, 422)) -> dict:
    assert response.status_code in status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", list(BAD_JSON_BODIES))
async def test_unparseable_body(client, rclient, redis_settings, route, name):
    response = await client.post(route, content=BAD_JSON_BODIES[name], headers={"content-type": "application/json"})
    assert_openai_error(response)
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", list(BAD_BODIES))
async def test_bad_body(client, rclient, redis_settings, route, name):
    response = await client.post(route, json=BAD_BODIES[name])
    error = assert_openai_error(response)
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []
    if name.startswith(("max_new_tokens", "temperature", "top_p", "top_k", "do_sample")):
        assert error["param"].startswith("parameters.")


@pytest.mark.parametrize("route", ROUTES)
async def test_prompt_too_long_names_both_numbers(client, rclient, redis_settings, tokenizer, route):
    text = "lorem ipsum dolor sit amet " * 400
    num_prompt = len(tokenizer.encode(text))
    assert num_prompt + 17 > 2048
    response = await client.post(route, json={"inputs": text, "parameters": {"max_new_tokens": 17}})
    error = assert_openai_error(response, status=(400,))
    assert f"prompt has {num_prompt} tokens" in error["message"]
    assert "max_new_tokens is 17" in error["message"] and "2048" in error["message"]
    assert error["code"] == "context_length_exceeded"
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


async def test_length_limit_is_inclusive(client, worker):
    """prompt + max_new_tokens == max_req_total_len is allowed."""
    response = await client.post("/v1/requests", json={"inputs": [5] * 2040, "parameters": {"max_new_tokens": 8}})
    assert response.status_code == 202
    response = await client.post("/v1/requests", json={"inputs": [5] * 2040, "parameters": {"max_new_tokens": 9}})
    assert response.status_code == 400 and "2049 exceeds max_req_total_len 2048" in response.json()["error"]["message"]


async def test_messages_name_the_problem(client):
    error = (await client.post("/generate", json={"inputs": "hi", "parameters": {"top_p": 0}})).json()["error"]
    assert error["param"] == "parameters.top_p" and "greater than 0" in error["message"]
    error = (await client.post("/generate", content=b"{bad")).json()["error"]
    assert error["code"] == "json_invalid" and "not valid JSON" in error["message"]
    error = (await client.post("/generate", content=b"")).json()["error"]
    assert error["message"] == "request body is empty"
    error = (await client.post("/generate", json={"inputs": [7, 99999]})).json()["error"]
    assert "99999" in error["message"] and "49152" in error["message"]


async def test_rejections_are_counted(client):
    await client.post("/generate", json={"inputs": ""})
    await client.post("/generate", content=b"{")
    await client.post("/generate", json={"inputs": "x", "parameters": {"top_k": -2}})
    text = (await client.get("/metrics")).text
    assert 'lightq:requests_rejected_total{reason="empty_input"} 1.0' in text
    assert 'lightq:requests_rejected_total{reason="invalid_json"} 1.0' in text
    assert 'lightq:requests_rejected_total{reason="invalid_request"} 1.0' in text

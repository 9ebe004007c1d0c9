"""Hostile input: oversized bodies (413), invalid UTF-8, deep nesting, huge and negative
numbers, non-finite floats: always a 4xx, never a 500, and nothing written to Redis."""

from __future__ import annotations

import httpx
import pytest

from producer.app import create_app
from producer.edge.body_limit import BodyLimit
from tests.redis_keys import keys_with_prefix
from tests.waiting import loop_turns_during

MODEL = "SmolLM2-135M-Instruct.Q4_1"
NATIVE = ["/generate", "/generate_stream", "/v1/requests"]


def native(params: bytes, inputs: bytes = b'"hi"') -> bytes:
    return b'{"inputs": ' + inputs + b', "parameters": ' + params + b"}"


def completion(fields: bytes) -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", ' + fields + b"}"


NATIVE_BODIES = {
    "invalid_utf8": b'{"inputs": "\xff\xfe\xc3"}',
    "lone_surrogate": b'{"inputs": "\\ud800"}',
    "overlong_utf8": b'{"inputs": "\xc0\xaf"}',
    "deep_list": native(b"[" * 10_000 + b"]" * 10_000),
    "deep_object": b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    "huge_int_literal": native(b'{"max_new_tokens": ' + b"9" * 5000 + b"}"),
    "huge_max_new_tokens": native(b'{"max_new_tokens": 100000000000000000000000000000}'),
    "huge_min_new_tokens": native(b'{"min_new_tokens": 100000000000000000000000000000}'),
    "huge_seed": native(b'{"seed": 100000000000000000000000000000}'),
    "huge_top_k": native(b'{"top_k": 100000000000000000000000}'),
    "huge_best_of": native(b'{"best_of": 100000000000000000000000}'),
    "huge_token_id": b'{"inputs": [' + b"9" * 400 + b"]}",
    "huge_stop_token_id": native(b'{"stop_sequences": [[100000000000000000000000]]}'),
    "float_overflow": native(b'{"temperature": 1e999}'),
    "infinity": native(b'{"temperature": Infinity}'),
    "nan": native(b'{"repetition_penalty": NaN}'),
    "negative_max_new_tokens": native(b'{"max_new_tokens": -1}'),
    "negative_temperature": native(b'{"temperature": -0.5}'),
    "negative_penalty": native(b'{"presence_penalty": -3}'),
    "negative_timeout": native(b'{"timeout": -5}'),
    "negative_token_id": b'{"inputs": [-5]}',
    "huge_timeout": native(b'{"timeout": 1e300}'),
    "many_stop_sequences": native(b'{"stop_sequences": [' + b",".join([b'"x"'] * 11) + b"]}"),
    "long_stop_sequence": native(b'{"stop_sequences": ["' + b"x" * 2000 + b'"]}'),
    "null_body": b"null",
    "string_body": b'"hi"',
}
OPENAI_BODIES = {
    "huge_max_tokens": completion(b'"max_tokens": 100000000000000000000000000000'),
    "huge_seed": completion(b'"seed": 100000000000000000000000000000'),
    "huge_top_k": completion(b'"top_k": 100000000000000000000000'),
    "float_overflow": completion(b'"temperature": 1e999'),
    "nan": completion(b'"top_p": NaN'),
    "negative_max_tokens": completion(b'"max_tokens": -1'),
    "negative_timeout": completion(b'"timeout": -1'),
    "huge_logprobs": completion(b'"logprobs": 100000000000000000000000'),
    "invalid_utf8": b'{"model": "\xff", "prompt": "hi"}',
    "deep_prompt": b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
}


def assert_refused(response: httpx.Response, statuses: tuple[int, ...] = (400, 404, 413, 422)) -> None:
    assert response.status_code in statuses, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("name", list(NATIVE_BODIES))
async def test_hostile_native_bodies(client, rclient, redis_settings, name):
    # The three native routes share their parsing: each body on each route would repeat this.
    routes = NATIVE if name in ("invalid_utf8", "deep_list", "huge_seed", "infinity") else ["/v1/requests"]
    for route in routes:
        assert_refused(await client.post(route, content=NATIVE_BODIES[name]))
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


@pytest.mark.parametrize("name", list(OPENAI_BODIES))
async def test_hostile_openai_bodies(client, rclient, redis_settings, name):
    assert_refused(await client.post("/v1/completions", content=OPENAI_BODIES[name]))
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


@pytest.fixture
async def small_bodies(settings, tokenizer):
    app = create_app(settings.model_copy(update={"max_body_bytes": 1000}), tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://producer", headers={"Content-Type": "application/json"}
        ) as client:
            yield client


@pytest.mark.parametrize("route", NATIVE + ["/v1/completions", "/v1/chat/completions"])
async def test_body_size_limit(small_bodies, rclient, redis_settings, route):
    body = b'{"inputs": "' + b"x" * 1000 + b'"}'
    response = await small_bodies.post(route, content=body)  # with a Content-Length
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    async def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b"x" * 200

    response = await small_bodies.post(route, content=chunks())
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []
    text = (await small_bodies.get("/metrics")).text
    assert 'lightq:requests_rejected_total{reason="too_large"} 2.0' in text


async def test_a_body_at_the_limit_is_read(small_bodies):
    body = b'{"inputs": [5]' + b" " * (1000 - 15) + b"}"
    assert len(body) == 1000
    assert (await small_bodies.post("/v1/requests", content=body)).status_code == 202


def test_batch_files_have_their_own_limit():
    limit = BodyLimit(None, max_bytes=1000, larger={"/v1/batches": 10**6})
    assert limit.limit("/v1/batches") == limit.limit("/v1/batches/abc/cancel") == 10**6
    assert limit.limit("/v1/requests") == limit.limit("/generate") == 1000


@pytest.mark.parametrize(
    "last_event_id", ["9" * 30 + "-0", "1-" + "9" * 30, "18446744073709551616-0", "²-1", "1-2-3", "-1", "0x10"]
)
async def test_bad_last_event_id_is_400(client, last_event_id):
    submitted = (await client.post("/v1/requests", json={"inputs": "hi"})).json()
    headers = [(b"last-event-id", last_event_id.encode("latin-1"))]
    assert_refused(await client.get(submitted["stream_url"], headers=headers), (400,))


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
async def test_prompt_text_too_long_for_any_tokenisation_is_400_untokenised(
    app, client, rclient, redis_settings, route
):
    """Text longer than the context times the longest text a token stands for cannot fit however it
    tokenises: a 400 before it is tokenised (a red team's 2 MB prompts took a core 1.5 s each)."""
    services = app.state.services
    assert services.max_prompt_chars == 2 * services.vocabulary.longest_token_chars() * 2048
    text = "a" * (services.max_prompt_chars + 1)
    body = {
        "/generate": {"inputs": text},
        "/v1/completions": {"model": MODEL, "prompt": text},
        "/v1/chat/completions": {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
        },
    }[route]
    response = await client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "characters cannot fit" in error["message"], error
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


class RawRequest:
    """What ``parse_body`` reads of a request: its body."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def body(self) -> bytes:
        return self.raw


async def test_a_large_body_is_validated_off_the_event_loop():
    """400,000 prompts in 1.6 MB took pydantic 3 s, every other client of the producer waiting (red
    team 5): past LARGE_BODY_BYTES the validation runs on a thread and the loop serves others."""
    import json

    from producer.api.openai_types import CompletionRequest
    from producer.deps import LARGE_BODY_BYTES, parse_body

    raw = json.dumps({"model": MODEL, "prompt": [[1]] * 40_000}).encode()
    assert len(raw) > LARGE_BODY_BYTES
    body, during = await loop_turns_during(parse_body(RawRequest(raw), CompletionRequest))
    assert len(body.prompt) == 40_000 and during > 0

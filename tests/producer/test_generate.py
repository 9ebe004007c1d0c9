"""/generate and /generate_stream: LightLLM's formats, fed by the fake worker."""

from __future__ import annotations

import asyncio
import json

from shared.schemas import RequestMeta, RequestStatus

PROMPT = "What is a message queue?"
STREAM_KEYS = {"token", "generated_text", "finished", "finish_reason", "details"}
TOKEN_KEYS = {"id", "text", "logprob", "special", "count_output_tokens", "prompt_tokens"}


def sse_events(body: str) -> list[dict]:
    """Parse LightLLM's framing strictly: ``data:`` (no space) + JSON, blank line."""
    assert body.endswith("\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data:{"), block
        events.append(json.loads(block.removeprefix("data:")))
    return events


async def test_generate_result_format(client, worker, tokenizer, aredis, keys):
    async def serve():
        request = await worker.take()
        meta = RequestMeta.from_hash(await aredis.hgetall(keys.meta(request.id)))
        ttl = await aredis.ttl(keys.meta(request.id))
        await worker.generate(request, ["Hello", " world", "!"])
        return request, meta, ttl

    task = asyncio.create_task(serve())
    body = {
        "inputs": PROMPT,
        "parameters": {
            "max_new_tokens": 3,
            "frequency_penalty": 0.5,
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 50,
            "seed": 7,
        },
    }
    response = await client.post("/generate", json=body)
    request, meta, ttl = await task
    prompt_ids = tokenizer.encode(PROMPT)
    assert response.status_code == 200
    assert response.json() == {
        "generated_text": ["Hello world!"],
        "count_output_tokens": 3,
        "finish_reason": "length",
        "prompt_tokens": len(prompt_ids),
    }
    assert request.prompt_ids == prompt_ids and len(request.id) == 32
    assert response.headers["X-Request-Id"] == request.id  # its status stays under this id
    assert request.params.max_new_tokens == 3 and request.params.top_k == 50 and request.params.seed == 7
    assert meta.prompt_tokens == len(prompt_ids) and meta.max_new_tokens == 3 and meta.created_ms > 0
    assert ttl == -1  # no TTL while the request lives: it starts when the request ends


async def test_generate_defaults_and_token_ids(client, worker, settings):
    task = asyncio.create_task(worker.take())
    response_task = asyncio.create_task(client.post("/generate", json={"inputs": [1, 2, 3]}))
    request = await task
    assert request.prompt_ids == [1, 2, 3]
    assert request.params.max_new_tokens == settings.default_max_new_tokens
    assert not request.params.do_sample and request.params.seed is None
    await worker.generate(request, ["a", "b"], finish_reason="stop")
    response = await response_task
    assert response.json() == {
        "generated_text": ["ab"],
        "count_output_tokens": 2,
        "finish_reason": "stop",
        "prompt_tokens": 3,
    }


async def test_generate_any_content_type(client, worker):
    task = asyncio.create_task(client.post("/generate", content=json.dumps({"inputs": "hi"}).encode()))
    await worker.generate(await worker.take(), ["x"], finish_reason="stop")
    assert (await task).json()["generated_text"] == ["x"]


async def test_generate_stream_format(client, worker, tokenizer):
    task = asyncio.create_task(client.post("/generate_stream", json={"inputs": PROMPT}))
    await worker.generate(await worker.take(), ["Hel", "lo", "!"], finish_reason="stop", delay_s=0.01)
    response = await task
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in response.text
    events = sse_events(response.text)
    assert [e["token"]["text"] for e in events] == ["Hel", "lo", "!"]
    for n, event in enumerate(events, start=1):
        assert set(event) == STREAM_KEYS and set(event["token"]) == TOKEN_KEYS
        assert event["token"]["count_output_tokens"] == n
        assert event["token"]["prompt_tokens"] == len(tokenizer.encode(PROMPT))
        assert event["token"]["special"] is False and event["token"]["id"] == 100 + n - 1
        assert event["generated_text"] is None and event["details"] is None
    assert [e["finished"] for e in events] == [False, False, True]
    assert [e["finish_reason"] for e in events] == [None, None, "stop"]


async def test_generate_stream_ends_on_failure(client, worker):
    task = asyncio.create_task(client.post("/generate_stream", json={"inputs": PROMPT}))
    request = await worker.take()
    await worker.token(request.id, 0, "Hi")
    await worker.end(request.id, 1, RequestStatus.FAILED, "error", error="worker died")
    events = sse_events((await task).text)
    assert [e["finished"] for e in events] == [False, True]
    last = events[-1]
    assert last["finish_reason"] == "error" and last["error"] == "worker died"
    assert last["token"]["id"] is None and last["token"]["count_output_tokens"] == 1


async def test_duplicate_indexes_are_dropped(client, worker):
    async def serve(texts_by_index):
        request = await worker.take()
        for index, text, reason in texts_by_index:
            await worker.token(request.id, index, text, finish_reason=reason)

    # A re-dispatched request repeats indexes 1 and 0 with different text: the first copy wins.
    script = [(0, "A", None), (1, "B", None), (1, "X", None), (0, "Y", None), (2, "C", "length")]
    task = asyncio.create_task(serve(script))
    response = await client.post("/generate", json={"inputs": PROMPT})
    await task
    assert response.json()["generated_text"] == ["ABC"] and response.json()["count_output_tokens"] == 3

    task = asyncio.create_task(serve(script))
    response = await client.post("/generate_stream", json={"inputs": PROMPT})
    await task
    assert [e["token"]["text"] for e in sse_events(response.text)] == ["A", "B", "C"]


async def test_generate_cancelled_and_failed(client, worker):
    task = asyncio.create_task(client.post("/generate", json={"inputs": PROMPT}))
    request = await worker.take()
    await worker.token(request.id, 0, "Par")
    await worker.end(request.id, 1, RequestStatus.CANCELLED, "cancelled")
    response = await task
    assert response.status_code == 200
    assert response.json() == {
        "generated_text": ["Par"],
        "count_output_tokens": 1,
        "finish_reason": "cancelled",
        "prompt_tokens": len(request.prompt_ids),
    }

    task = asyncio.create_task(client.post("/generate", json={"inputs": PROMPT}))
    request = await worker.take()
    await worker.end(request.id, 0, RequestStatus.FAILED, "error", error="CUDA out of memory")
    response = await task
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "CUDA out of memory"


async def test_status_without_terminal_chunk_ends_stream(client, worker, keys, aredis):
    """A request finalised only in its status hash still ends the client's wait."""
    task = asyncio.create_task(client.post("/generate_stream", json={"inputs": PROMPT}))
    request = await worker.take()
    await worker.set_meta(request.id, status=RequestStatus.CANCELLED, finish_reason="cancelled")
    events = sse_events((await task).text)
    assert len(events) == 1 and events[0]["finished"] and events[0]["finish_reason"] == "cancelled"

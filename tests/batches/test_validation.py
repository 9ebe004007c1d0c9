"""A bad batch file gets a 400 naming its first bad line, and nothing is written or enqueued."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from producer.batches.records import parse_lines, validate_lines
from producer.batches.rq_worker import queue
from tests.batches.helpers import MODEL, chat_line, completion_line, generate_line, jsonl
from tests.redis_keys import keys_with_prefix
from tests.waiting import loop_turns_during

GOOD = json.dumps(completion_line("ok")) + "\n"

CASES = {
    "not json": (GOOD + "{not json\n", "line 2: the line is not valid JSON"),
    "not an object": ("[1, 2]\n", "line 1: "),
    "wrong method": (jsonl({**completion_line("a"), "method": "GET"}), "line 1: method"),
    "unknown url": (jsonl({**completion_line("a"), "url": "/v1/embeddings"}), "line 1: url"),
    "no custom_id": (jsonl({k: v for k, v in completion_line("a").items() if k != "custom_id"}), "line 1: custom_id"),
    "duplicate custom_id": (
        jsonl(completion_line("a"), chat_line("b"), generate_line("a")),
        "line 3: custom_id 'a' is already used on line 1",
    ),
    "blank lines count": ("\n" + GOOD + "\n" + jsonl({**completion_line("x"), "url": "/nope"}), "line 4: url"),
    "unknown model": (
        GOOD + jsonl(completion_line("b", model="gpt-9")),
        "line 2: /v1/completions (custom_id 'b'): The model 'gpt-9' does not exist",
    ),
    "too long": (jsonl(completion_line("a", max_tokens=5000)), "maximum context length is 2048"),
    "bad parameter": (
        jsonl(generate_line("a"), {**generate_line("b"), "body": {"inputs": "x", "parameters": {"top_p": 7}}}),
        "line 2: /generate (custom_id 'b'): parameters.top_p",
    ),
    "empty prompt": (
        jsonl(chat_line("a"), {**chat_line("b"), "body": {"model": MODEL, "messages": []}}),
        "line 2: /v1/chat/completions (custom_id 'b'): messages",
    ),
    "stream": (jsonl(completion_line("a", stream=True)), "line 1: /v1/completions (custom_id 'a'): stream"),
    "empty file": ("\n\n", "the file has no requests"),
    # What OpenAI's SDK sends after an upload to /v1/files (lightq has none): said so (red team 4)
    "a file id": (json.dumps({"input_file_id": "file-abc", "endpoint": "/v1/chat/completions"}), "no /v1/files"),
}


@pytest.mark.parametrize("case", CASES)
async def test_a_bad_file_is_refused_whole_naming_the_line(case, client, rclient, redis_settings, rq_conn, rq_names):
    text, message = CASES[case]
    response = await client.post("/v1/batches", content=text)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []  # no batch records, no ingress entries
    assert queue(rq_names.batch, rq_conn).count == 0


async def test_a_file_that_is_not_utf8_is_refused(client):
    response = await client.post("/v1/batches", content=b"\xff\xfe" + GOOD.encode())
    assert response.status_code == 400
    assert "UTF-8" in response.json()["error"]["message"]


async def test_too_many_requests_are_refused(app, client, settings):
    text = jsonl(*[completion_line(f"r{i}") for i in range(3)])
    limited = settings.model_copy(update={"batch": settings.batch.model_copy(update={"max_requests": 2})})
    app.state.services = replace(app.state.services, settings=limited)
    response = await client.post("/v1/batches", content=text)
    assert response.status_code == 400
    assert "more than 2 requests" in response.json()["error"]["message"]


async def test_a_byte_order_mark_is_not_the_first_lines_problem(client, rq_conn, rq_names):
    """Notepad's UTF-8 files start with one: it was "line 1: the line is not valid JSON" (red team 4)."""
    response = await client.post("/v1/batches", content=b"\xef\xbb\xbf" + GOOD.encode())
    assert response.status_code == 202, response.text
    assert queue(rq_names.batch, rq_conn).count == 1


async def test_checking_a_file_lets_other_clients_in_between_its_lines(app):
    """A line's checks may never await (a token-id prompt), so 50,000 of them held every client of
    the producer for minutes (red team 5): the check yields to the event loop between lines."""
    lines = parse_lines(jsonl(*[completion_line(f"c{i}", prompt=[1] * 50) for i in range(200)]), 1000)
    _, during = await loop_turns_during(validate_lines(lines, list(range(1, 201)), app.state.services))
    assert during >= 200  # a turn between every two lines (none at all before)

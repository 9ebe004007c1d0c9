"""Submit-and-poll: /v1/requests, status, cancel, and the replayable stream."""

from __future__ import annotations

import asyncio
import json

import pytest

from producer.api import routes_requests
from shared.schemas import RequestStatus

BODY = {"inputs": "Tell me about Redis streams.", "parameters": {"max_new_tokens": 8}}
VIEW_KEYS = {
    "id",
    "status",
    "output_text",
    "output_texts",
    "output_tokens",
    "prompt_tokens",
    "finish_reason",
    "error",
    "worker",
    "created_ms",
    "dispatched_ms",
    "taken_ms",
    "stepped_ms",
    "started_ms",
    "finished_ms",
    "priority",
    "queue_position",
    "estimated_wait_s",
}


def replay_events(body: str) -> list[tuple[str, dict]]:
    events = []
    for block in body.split("\n\n")[:-1]:
        id_line, data_line = block.split("\n")
        assert id_line.startswith("id: ") and data_line.startswith("data: ")
        events.append((id_line.removeprefix("id: "), json.loads(data_line.removeprefix("data: "))))
    return events


async def submit(client) -> str:
    response = await client.post("/v1/requests", json=BODY)
    assert response.status_code == 202
    accepted = response.json()
    request_id = accepted["id"]
    assert accepted == {
        "id": request_id,
        "status_url": f"/v1/requests/{request_id}",
        "stream_url": f"/v1/requests/{request_id}/stream",
    }
    return request_id


async def test_submit_poll_finished(client, worker, tokenizer):
    request_id = await submit(client)
    view = (await client.get(f"/v1/requests/{request_id}")).json()
    assert set(view) == VIEW_KEYS
    assert view["status"] == "queued" and view["output_text"] == "" and view["output_tokens"] == 0
    assert view["prompt_tokens"] == len(tokenizer.encode(BODY["inputs"])) and view["created_ms"] > 0

    request = await worker.take()
    assert request.id == request_id
    await worker.token(request_id, 0, "Streams")
    view = (await client.get(f"/v1/requests/{request_id}")).json()
    assert view["status"] == "running" and view["output_text"] == "Streams" and view["output_tokens"] == 1

    await worker.token(request_id, 1, " are", finish_reason="stop")
    await worker.set_meta(
        request_id, status=RequestStatus.FINISHED, finish_reason="stop", output_tokens=2, finished_ms=1
    )
    view = (await client.get(f"/v1/requests/{request_id}")).json()
    assert view["status"] == "finished" and view["output_text"] == "Streams are"
    assert view["output_tokens"] == 2 and view["finish_reason"] == "stop" and view["worker"] == "fake-worker"
    assert view["dispatched_ms"] and view["started_ms"] and view["finished_ms"] == 1


@pytest.mark.parametrize("path", ["/v1/requests/{id}", "/v1/requests/{id}/stream"])
@pytest.mark.parametrize("request_id", ["0" * 32, "not-an-id", "%7Bq%7D"])
async def test_unknown_id_is_404(client, path, request_id):
    response = await client.get(path.format(id=request_id))
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    assert (await client.delete(f"/v1/requests/{request_id}")).status_code == 404


async def test_delete_cancels_and_reports(client, worker, aredis, keys):
    request_id = await submit(client)

    async def holder():
        request = await worker.take()
        await worker.token(request.id, 0, "Par")
        assert await worker.wait_cancel(request.id)
        await worker.end(request.id, 1, RequestStatus.CANCELLED, "cancelled")

    task = asyncio.create_task(holder())
    await asyncio.sleep(0.3)
    response = await client.delete(f"/v1/requests/{request_id}")
    await task
    assert response.status_code == 200
    view = response.json()
    assert view["status"] == "cancelled" and view["finish_reason"] == "cancelled" and view["output_text"] == "Par"
    assert await aredis.get(keys.cancel(request_id)) == "1"
    assert 0 < await aredis.ttl(keys.cancel(request_id)) <= 3600


async def test_delete_terminal_and_unanswered(client, worker, aredis, keys, monkeypatch):
    request_id = await submit(client)
    await worker.generate(await worker.take(), ["done"], finish_reason="stop")
    response = await client.delete(f"/v1/requests/{request_id}")
    assert response.status_code == 200 and response.json()["status"] == "finished"
    assert not await aredis.exists(keys.cancel(request_id))  # nothing to cancel

    monkeypatch.setattr(routes_requests, "CANCEL_WAIT_S", 0.3)
    request_id = await submit(client)  # nobody holds it: still queued after the wait
    response = await client.delete(f"/v1/requests/{request_id}")
    assert response.status_code == 202 and response.json()["status"] == "queued"
    assert await aredis.exists(keys.cancel(request_id))


async def test_stream_replay_and_resume(client, worker):
    request_id = await submit(client)
    request = await worker.take()
    entry_ids = await worker.generate(request, ["one", " two", " three"])
    response = await client.get(f"/v1/requests/{request_id}/stream")
    assert response.headers["content-type"].startswith("text/event-stream")
    events = replay_events(response.text)
    assert [event_id for event_id, _ in events] == entry_ids
    assert [chunk["text"] for _, chunk in events] == ["one", " two", " three"]
    assert events[-1][1]["finished"] and events[-1][1]["request_id"] == request_id

    resumed = await client.get(f"/v1/requests/{request_id}/stream", headers={"Last-Event-ID": entry_ids[0]})
    assert [(i, c["index"]) for i, c in replay_events(resumed.text)] == [(entry_ids[1], 1), (entry_ids[2], 2)]

    bad = await client.get(f"/v1/requests/{request_id}/stream", headers={"Last-Event-ID": "nope"})
    assert bad.status_code == 400


async def test_resume_inside_a_run_is_exact(client, worker):
    """A run of several tokens is one entry; each token still has an event id of its own (``entry.k``),
    and Last-Event-ID resumes right after the token it names, also inside a run."""
    request_id = await submit(client)
    request = await worker.take()
    event_ids = await worker.generate(request, ["a", "b", "c", "d", "e"], run_len=3)
    assert len({e.partition(".")[0] for e in event_ids}) == 2  # two entries: 3 tokens, then 2
    events = replay_events((await client.get(f"/v1/requests/{request_id}/stream")).text)
    assert [(i, c["text"]) for i, c in events] == list(zip(event_ids, "abcde"))
    for k, after in enumerate(event_ids):
        resumed = await client.get(f"/v1/requests/{request_id}/stream", headers={"Last-Event-ID": after})
        assert [(i, c["text"]) for i, c in replay_events(resumed.text)] == list(zip(event_ids, "abcde"))[k + 1 :]


async def test_stream_follows_live_and_drops_repeats(client, worker):
    request_id = await submit(client)
    task = asyncio.create_task(client.get(f"/v1/requests/{request_id}/stream"))
    request = await worker.take()
    first = await worker.token(request.id, 0, "a")
    await worker.token(request.id, 0, "again")  # a re-dispatched attempt repeats index 0
    last = await worker.token(request.id, 1, "b", finish_reason="length")
    events = replay_events((await task).text)
    assert [(i, c["text"]) for i, c in events] == [(first, "a"), (last, "b")]

    # Resuming after the first entry must still drop the repeat of index 0.
    resumed = await client.get(f"/v1/requests/{request_id}/stream", headers={"Last-Event-ID": first})
    assert [c["text"] for _, c in replay_events(resumed.text)] == ["b"]


async def test_a_groups_view_and_replay_carry_every_sample(client, worker, aredis, keys):
    """n > 1: the status gives each sample's text and the replay every sample's tokens to the end of
    the last; before, both held sample 0 alone (the replay ended with it) while output_tokens
    counted all (red team 3)."""
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 2, "n": 3, "best_of": 3, "do_sample": True}}
    task = asyncio.create_task(client.post("/generate", json=body))  # (/v1/requests takes n = 1 only)
    request = await worker.take()
    await worker.generate(request, ["a", "b"])
    response = await task
    assert response.status_code == 200, response.text
    request_id = response.headers["X-Request-Id"]
    assert (await aredis.hget(keys.meta(request_id), "samples")) == "3"
    view = (await client.get(f"/v1/requests/{request_id}")).json()
    assert view["output_text"] == "ab" and view["output_texts"] == ["ab", "a1b1", "a2b2"]
    events = replay_events((await client.get(f"/v1/requests/{request_id}/stream")).text)
    by_choice = {c: [e["text"] for _, e in events if e["choice"] == c] for c in range(3)}
    assert by_choice == {0: ["a", "b"], 1: ["a1", "b1"], 2: ["a2", "b2"]}
    assert sum(e["finished"] for _, e in events) == 3

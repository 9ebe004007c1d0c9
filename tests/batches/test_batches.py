"""``/v1/batches`` with real Redis, a real rq worker (in-process) and the fake worker as the pool."""

from __future__ import annotations

import asyncio

from producer.batches.job import on_failure
from producer.batches.rq_worker import queue
from shared.codec import from_entry
from shared.schemas import GenerateRequest
from tests.batches.helpers import chat_line, completion_line, generate_line, jsonl, output_lines, pool


async def submit(client, text: str) -> dict:
    response = await client.post("/v1/batches", content=text, headers={"Content-Type": "application/jsonl"})
    assert response.status_code == 202, response.text
    return response.json()


async def test_a_batch_answers_every_url_like_its_route_in_input_order(client, worker, run_rq, rclient, keys):
    text = jsonl(completion_line("c1"), chat_line("c2"), generate_line("g3"), completion_line("bad", max_tokens=5))
    view = await submit(client, text)
    assert view["status"] == "queued" and view["endpoint"] == "mixed"
    assert view["request_counts"] == {"total": 4, "completed": 0, "failed": 0}
    assert view["status_counts"] == {"pending": 4, "queued": 0, "running": 0, "completed": 0, "failed": 0}
    assert view["output_url"] is None

    async with pool(worker, fail_max_new=5):
        assert await run_rq()

    view = (await client.get(f"/v1/batches/{view['id']}")).json()
    assert view["status"] == "completed"
    assert view["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert view["created_at"] <= view["in_progress_at"] <= view["completed_at"]
    out = output_lines((await client.get(view["output_url"])).text)
    assert [line["custom_id"] for line in out] == ["c1", "c2", "g3", "bad"]
    c1, c2, g3, bad = out
    assert all(line["id"] == f"batch_req_{line['response']['request_id']}" for line in out)
    assert c1["response"]["status_code"] == 200 and c1["error"] is None
    assert c1["response"]["body"]["object"] == "text_completion"
    assert c1["response"]["body"]["id"] == f"cmpl-{c1['response']['request_id']}"
    assert c1["response"]["body"]["choices"][0]["text"] == " a b"
    assert c1["response"]["body"]["usage"]["completion_tokens"] == 2
    assert c2["response"]["body"]["choices"][0]["message"]["content"] == " a b"
    assert g3["response"]["body"]["generated_text"] == [" a b"]
    assert g3["response"]["body"]["count_output_tokens"] == 2
    assert bad["response"]["status_code"] == 500
    assert bad["response"]["body"]["error"]["code"] == "generation_failed"
    # Working records are gone; what stays has a TTL.
    assert not rclient.exists(keys.batch_results(view["id"]), keys.batch_inflight(view["id"]))
    assert all(
        rclient.ttl(key) > 0
        for key in (keys.batch(view["id"]), keys.batch_input(view["id"]), keys.batch_output(view["id"]))
    )


async def test_a_line_whose_answer_cannot_be_read_fails_alone(client, worker, run_rq, rclient, keys):
    # A poison line (an entry no reader takes, as a NaN logprob once wrote): its own 500, and the
    # batch completes with the other lines answered (it failed whole after rq's retries).
    view = await submit(client, jsonl(completion_line("a"), completion_line("poison", max_tokens=7), chat_line("c")))
    async with pool(worker, poison_max_new=7):
        assert await run_rq()
    view = (await client.get(f"/v1/batches/{view['id']}")).json()
    assert view["status"] == "completed", view
    assert view["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    a, poison, c = output_lines((await client.get(view["output_url"])).text)
    assert a["response"]["status_code"] == 200 and c["response"]["status_code"] == 200
    assert poison["response"]["status_code"] == 500
    assert poison["response"]["body"]["error"]["code"] == "generation_failed"
    assert not rclient.exists(keys.batch_results(view["id"]), keys.batch_inflight(view["id"]))


async def test_no_more_than_max_in_flight_requests_are_in_the_pool(client, worker, run_rq, aredis, keys, settings):
    assert settings.batch.max_in_flight == 2
    view = await submit(client, jsonl(*[completion_line(f"r{i}") for i in range(6)]))
    peak = 0

    async def unanswered() -> int:
        ids = [from_entry(GenerateRequest, fields).id for _, fields in await aredis.xrange(keys.requests())]
        lasts = [await aredis.xrevrange(keys.chunks(rid), count=1) for rid in ids]
        return sum(not last or '"finished":true' not in last[0][1]["msg"] for last in lasts)

    sampling = [True]  # a flag, not cancel(): redis-py can swallow a CancelledError inside a command, and a
    # sampler that missed its cancel ran on into the fixtures' teardown (a 600 s hang, seen under load)

    async def sample() -> None:
        nonlocal peak
        while sampling[0]:
            peak = max(peak, await unanswered())
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    async with pool(worker, delay_s=0.03) as taken:
        await run_rq()
    sampling[0] = False
    await sampler  # done before the fixtures close its Redis client
    assert len(taken) == 6
    assert peak == 2
    assert (await client.get(f"/v1/batches/{view['id']}")).json()["request_counts"]["completed"] == 6


async def test_progress_counts_lines_by_where_they_are(client, worker, run_rq):
    view = await submit(client, jsonl(*[completion_line(f"r{i}") for i in range(5)]))
    job = asyncio.create_task(run_rq())
    for _ in range(200):  # nobody answers yet: two sent, three waiting
        view = (await client.get(f"/v1/batches/{view['id']}")).json()
        if view["status_counts"]["queued"] == 2:
            break
        await asyncio.sleep(0.02)
    assert view["status"] == "in_progress"
    assert view["status_counts"] == {"pending": 3, "queued": 2, "running": 0, "completed": 0, "failed": 0}
    async with pool(worker):
        await job
    view = (await client.get(f"/v1/batches/{view['id']}")).json()
    assert view["status_counts"] == {"pending": 0, "queued": 0, "running": 0, "completed": 5, "failed": 0}


async def test_a_restarted_job_resumes_without_sending_anything_twice(client, worker, run_rq, aredis, keys, app):
    from producer.api.submit import enqueue
    from producer.batches.records import parse_lines, prepare_line

    text = jsonl(completion_line("done"), completion_line("sent"), completion_line("new"))
    batch_id = (await submit(client, text))["id"]
    # As an interrupted run leaves it: line 0 answered, line 1's request in the pool, line 2 not sent.
    await aredis.hset(keys.batch_results(batch_id), "0", '{"custom_id": "done", "from": "the first run"}')
    await aredis.hincrby(keys.batch(batch_id), "completed", 1)
    services = app.state.services
    sent = await prepare_line(parse_lines(text, 10)[1], services)
    await aredis.hset(keys.batch_inflight(batch_id), "1", sent.request.id)
    await enqueue(sent.request, "batch", services)

    async with pool(worker) as taken:
        await run_rq()
    assert len(taken) == 2  # the one already sent, and the new one
    view = (await client.get(f"/v1/batches/{batch_id}")).json()
    assert view["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    out = output_lines((await client.get(f"/v1/batches/{batch_id}/output")).text)
    assert out[0] == {"custom_id": "done", "from": "the first run"}
    assert out[1]["response"]["request_id"] == sent.request.id
    assert out[2]["response"]["body"]["choices"][0]["text"] == " a b"


async def test_cancel_stops_sending_and_cancels_what_is_in_the_pool(client, worker, run_rq, settings):
    from shared.schemas import RequestStatus

    view = await submit(client, jsonl(*[completion_line(f"r{i}") for i in range(4)]))
    job = asyncio.create_task(run_rq())
    first = await worker.take()
    second = await worker.take()
    cancelled = (await client.post(f"/v1/batches/{view['id']}/cancel")).json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"]
    for request in (first, second):
        assert await worker.wait_cancel(request.id)
        await worker.token(request.id, 0, " x")
        await worker.end(request.id, 1, RequestStatus.CANCELLED, "cancelled")
    await job
    view = (await client.get(f"/v1/batches/{view['id']}")).json()
    assert view["status"] == "cancelled" and view["cancelled_at"]
    assert view["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    out = output_lines((await client.get(view["output_url"])).text)
    assert [line["response"]["body"]["choices"][0]["finish_reason"] for line in out[:2]] == ["abort", "abort"]
    assert [line["response"]["body"]["choices"][0]["text"] for line in out[:2]] == [" x", " x"]
    assert [line["error"]["code"] for line in out[2:]] == ["batch_cancelled", "batch_cancelled"]
    assert all(line["response"] is None for line in out[2:])


async def test_unknown_batches_are_404_and_unfinished_output_is_409(client):
    missing = "batch_" + "0" * 32
    for path in (f"/v1/batches/{missing}", f"/v1/batches/{missing}/output", "/v1/batches/nope"):
        response = await client.get(path)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
    assert (await client.post(f"/v1/batches/{missing}/cancel")).status_code == 404
    view = await submit(client, jsonl(completion_line("a")))
    response = await client.get(f"/v1/batches/{view['id']}/output")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "batch_not_finished"


async def test_a_job_out_of_retries_marks_its_batch_failed_and_keeps_what_it_answered(
    client, settings, rq_conn, rq_names, rclient, keys
):
    view = await submit(client, jsonl(completion_line("a"), completion_line("b"), completion_line("c")))
    batch_id = view["id"]
    job = queue(rq_names.batch, rq_conn).jobs[0]
    assert job.retries_left == settings.batch.retries
    # As a run leaves them when it dies: line 0 answered, line 1 sent and unanswered, line 2 not sent.
    answered = '{"id": "batch_req_r0", "custom_id": "a", "response": {"status_code": 200}, "error": null}'
    rclient.hset(keys.batch_results(batch_id), "0", answered)
    rclient.hincrby(keys.batch(batch_id), "completed", 1)
    rclient.hset(keys.batch_inflight(batch_id), "1", "r1")
    job.retries_left = 0
    on_failure(job, rq_conn, RuntimeError, RuntimeError("boom"), None)
    view = (await client.get(f"/v1/batches/{batch_id}")).json()
    assert view["status"] == "failed" and view["failed_at"] and view["expires_at"]
    assert "RuntimeError: boom" in view["error"]
    assert view["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    response = await client.get(view["output_url"])
    assert response.status_code == 200, response.text
    first, second, third = output_lines(response.text)
    assert first == {"id": "batch_req_r0", "custom_id": "a", "response": {"status_code": 200}, "error": None}
    assert second["custom_id"] == "b" and second["id"] == "batch_req_r1" and second["response"] is None
    assert third["custom_id"] == "c" and third["response"] is None
    assert {second["error"]["code"], third["error"]["code"]} == {"batch_failed"}
    assert "RuntimeError: boom" in third["error"]["message"]
    # The working records are gone; what stays has the batch's TTL.
    assert not rclient.exists(keys.batch_results(batch_id), keys.batch_inflight(batch_id))
    assert all(
        0 < rclient.ttl(key) <= settings.batch.ttl_s
        for key in (keys.batch(batch_id), keys.batch_input(batch_id), keys.batch_output(batch_id))
    )

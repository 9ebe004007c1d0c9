"""A low-priority group is paused for high-priority work and still completes exactly (issue 33 item 7),
through ``lightq serve`` with the router's ``--preempt`` (real processes, real Redis; the counting
model, whose next token is the last plus one, so every output is known in advance).

One worker whose pool a group of 3 samples nearly fills (conservative admission: 8 + 3 x 240 of 760
tokens); once every sample has sent tokens, a class-0 request that fits nowhere arrives. Without a
pause it could start only when the group ended. With one, the class-0 request ends first, and the
group, sent back with each sample's tokens, resumes and ends with every sample's 240 tokens exact:
in the chunk stream each (choice, index) once, and the client's answer the same. On one Redis node and
on a Redis Cluster (the pause's hand-back crosses slots: the worker's records, the group's keys, the
ingress)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from shared.chunk_schemas import TokenChunk
from shared.chunks import parse_run
from shared.schemas import RequestMeta, RequestStatus
from tests.integration.stack import remove_prefix_keys, start_stack
from tests.waiting import MUST_HAPPEN_S

pytestmark = pytest.mark.slow

POOL = 760
GROUP_NEW, URGENT_NEW, N = 240, 40, 3
PROMPT = [100] * 8  # the counting model answers 101, 102, ...
EXPECTED = [101 + i for i in range(GROUP_NEW)]


@pytest.fixture(params=["node", "cluster"])
def stack(request, tmp_path, redis_settings):
    """On one Redis node, and on the session's 3+3 Redis Cluster (flushed before and after; rq's queue
    on the plain node, as a cluster deployment has it)."""
    extra = ["--model_dir", "counting", "--preempt", "--admission", "conservative"]
    extra += ["--max_total_token_num", str(POOL), "--max_req_total_len", "256"]
    extra += ["--counting_step_ms", "25"]  # a step as a GPU's might take: the group runs for seconds
    url = redis_settings.url
    if request.param == "cluster":
        url = request.getfixturevalue("clean_cluster").url
        extra += ["--redis_rq_url", redis_settings.url]
    stack = start_stack(
        str(tmp_path / "serve.log"), redis_url=url, prefix=redis_settings.key_prefix, workers=1, extra=extra
    )
    try:
        yield stack
    finally:
        if request.param == "node":
            stack.close()
        else:  # clean_cluster flushes the cluster; rq's keys are on the plain node
            try:
                assert stack.stop() == 0, open(stack.log_path).read()[-3000:]
            finally:
                remove_prefix_keys(redis_settings.url, redis_settings.key_prefix)


def generate(http: str, max_new: int, priority: int, n: int = 1) -> dict:
    params = {"max_new_tokens": max_new, "ignore_eos": True, "priority": priority, "n": n, "best_of": n}
    params["return_details"] = True
    response = httpx.post(f"{http}/generate", json={"inputs": PROMPT, "parameters": params}, timeout=MUST_HAPPEN_S)
    assert response.status_code == 200, response.text
    return response.json()


def the_only_request(client, keys, sending: threading.Thread) -> str:
    """The id of the one request this stack has seen (the group), once the producer queued it."""
    deadline = time.monotonic() + MUST_HAPPEN_S
    while time.monotonic() < deadline and sending.is_alive():  # a hang guard: queued within moments
        found = list(client.scan_iter(match=keys.meta("*")))
        if found:
            (key,) = found
            return key.split(":r:", 1)[1].removesuffix(":meta")
        time.sleep(0.05)
    raise AssertionError("the group was never queued")


def wait_tokens(client, keys, request_id: str, count: int) -> None:
    """Until ``count`` tokens of the request are in its chunk stream: XREAD blocks until it grows."""
    last, seen, deadline = "0-0", 0, time.monotonic() + MUST_HAPPEN_S
    while seen < count:
        assert time.monotonic() < deadline, f"{seen} of {count} tokens written"
        for _, written in client.xread({keys.chunks(request_id): last}, block=1000) or []:
            seen += sum(len(parse_run(fields).tokens()) for _, fields in written)
            last = written[-1][0]


def written(client, keys, request_id: str) -> list[TokenChunk]:
    """Every token of the stream, repeats included (a reader would drop them: here none may be)."""
    return [c for _, f in client.xrange(keys.chunks(request_id)) for c in parse_run(f).tokens()]


def test_a_low_priority_group_is_paused_for_high_priority_work_and_completes_exactly(stack):
    client = stack.client()
    answers: dict[str, dict] = {}
    group = threading.Thread(target=lambda: answers.update(group=generate(stack.http, GROUP_NEW, 1, n=N)))
    group.start()
    try:
        group_id = the_only_request(client, stack.keys, group)
        wait_tokens(client, stack.keys, group_id, 2 * N)  # running, with tokens a pause must keep
        urgent = generate(stack.http, URGENT_NEW, 0)
    finally:
        group.join(MUST_HAPPEN_S)
    assert urgent["count_output_tokens"] == URGENT_NEW and "group" in answers

    metas = {k: RequestMeta.from_hash(client.hgetall(k)) for k in client.scan_iter(match=stack.keys.meta("*"))}
    assert [m.status for m in metas.values()] == [RequestStatus.FINISHED] * 2
    group_meta = metas.pop(stack.keys.meta(group_id))
    (urgent_meta,) = metas.values()
    # the group made room: it was paused
    assert urgent_meta.finished_ms < group_meta.finished_ms, stack.test_log()[-6000:]
    assert group_meta.output_tokens == N * GROUP_NEW
    assert f"paused ['{group_id}']" in stack.test_log()
    (record,) = stack.live_workers().values()
    assert record.preempted_requests == 1

    chunks = written(client, stack.keys, group_id)
    for choice in range(N):  # each index once over both attempts, none lost, none repeated
        mine = [c for c in chunks if c.choice == choice]
        assert [c.index for c in mine] == list(range(GROUP_NEW)), choice
        assert [c.token_id for c in mine] == EXPECTED, choice
    answer = answers["group"]
    assert answer["count_output_tokens"] == [GROUP_NEW] * N
    assert [[t["id"] for t in sample] for sample in answer["tokens"]] == [EXPECTED] * N
    client.close()

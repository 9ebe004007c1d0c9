"""Prefix routing through a whole pool (``lightq serve``, the counting model, real Redis): a
conversation's next turn goes to the worker that served its first, because that worker's load record
says its prefix cache holds the first turn, and there it is a cache hit. On one Redis node (3 workers)
and on the 3+3 Redis Cluster (2 workers), where the records and the ingress are on different slots.

Eight conversations; each second turn must be the routers' ``prefix_hit`` decision (their counts by
reason, summed in Redis) and a hit in the holder's cache: an idle pool's tie-break alone would send
every turn to the same worker."""

from __future__ import annotations

import time

import httpx

from shared.prefix_hash import prefix_hashes
from tests.waiting import MUST_HAPPEN_S

CONVERSATIONS, FIRST_LEN, ANSWER_LEN, NEXT_LEN = 8, 320, 16, 64


def generate(http: str, prompt: list[int], max_new: int) -> tuple[str, list[int]]:
    """The request's id (/generate's ``X-Request-Id``) and its output tokens (it has ended by then)."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new, "ignore_eos": True, "return_details": True}}
    response = httpx.post(f"{http}/generate", json=body, timeout=MUST_HAPPEN_S)
    assert response.status_code == 200, response.text
    return response.headers["X-Request-Id"], [t["id"] for t in response.json()["tokens"]]


def served_by(stack, request_id: str) -> str:
    status = httpx.get(f"{stack.http}/v1/requests/{request_id}", timeout=30).json()
    assert status["status"] == "finished", status
    return status["worker"]


def until_held(stack, worker: str, prompt: list[int]) -> int:
    """Until ``worker``'s load record lists a prefix of ``prompt`` (its heartbeat carries the cache's
    summary); its prefix-hit tokens so far."""
    wanted, deadline = set(prefix_hashes(prompt)), time.monotonic() + MUST_HAPPEN_S
    while True:
        record = stack.live_workers().get(worker)
        if record is not None and any(h in wanted for h, _ in record.prefixes):
            return record.prefix_hit_tokens
        assert time.monotonic() < deadline, f"{worker}'s record never listed the prompt's prefix"
        time.sleep(0.05)


def decisions(stack, reason: str, at_least: int = 0) -> int:
    """The pool's routers' decisions for ``reason`` (summed in Redis at most a second late), once at
    least ``at_least``."""
    client, deadline = stack.client(), time.monotonic() + MUST_HAPPEN_S
    try:
        while (count := int(client.hget(stack.keys.router_decisions(), reason) or 0)) < at_least:
            assert time.monotonic() < deadline, f"{count} '{reason}' decisions, not {at_least}"
            time.sleep(0.1)
        return count
    finally:
        client.close()


def next_turns_follow_their_conversations(stack) -> None:
    hits = decisions(stack, "prefix_hit")
    for c in range(CONVERSATIONS):
        first = [(7 * c + i) % 4000 + 1 for i in range(FIRST_LEN)]  # a prompt of its own (vocabulary 4,096)
        first_id, answer = generate(stack.http, first, ANSWER_LEN)
        holder = served_by(stack, first_id)
        cache_hits = until_held(stack, holder, first)
        next_turn = first + answer + [(c + i) % 4000 + 1 for i in range(NEXT_LEN)]
        next_id, _ = generate(stack.http, next_turn, ANSWER_LEN)
        assert served_by(stack, next_id) == holder, f"conversation {c}: its next turn left {holder}"
        # chosen for the hit (on an idle pool a tie-break could send every turn to one worker) ...
        hits = decisions(stack, "prefix_hit", hits + 1)
        deadline = time.monotonic() + MUST_HAPPEN_S  # ... and a hit there: the cache's counter grew
        while stack.live_workers()[holder].prefix_hit_tokens - cache_hits < FIRST_LEN // 2:
            assert time.monotonic() < deadline, f"conversation {c}: no prefix hit on {holder}"
            time.sleep(0.05)


def test_a_conversations_next_turn_goes_to_its_worker_on_one_node(counting_trio_stack):
    next_turns_follow_their_conversations(counting_trio_stack)


def test_a_conversations_next_turn_goes_to_its_worker_on_the_cluster(counting_cluster_stack):
    next_turns_follow_their_conversations(counting_cluster_stack)

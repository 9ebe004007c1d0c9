"""``lightq dead-letters``: list and requeue against a real Redis."""

import subprocess
import sys

import pytest

from lightq.dead_letters import list_dead, requeue_dead
from router.loop import Router
from shared.chunk_schemas import TokenChunk
from shared.chunks import parse_run
from shared.codec import entry, from_entry
from shared.config import RouterSettings
from shared.schemas import DeadLetter, GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from tests.chunks import append_chunk
from tests.router.helpers import publish_load, start_on, submit


def dead_letter_one(redis_settings, rclient, keys) -> None:
    router = Router(RouterSettings(redis=redis_settings, poll_ms=10, max_attempts=1), rclient, "r1")
    submit(rclient, keys, "p")
    publish_load(rclient, keys, "w1")
    router.step()
    router.step()
    start_on(rclient, keys, "p", "w1")  # the worker's death is blamed on it (its one attempt)
    pipe = rclient.pipeline()
    append_chunk(pipe, keys, TokenChunk(request_id="p", index=0, token_id=42, text="x"))
    pipe.execute()
    rclient.delete(keys.load("w1"))
    router.step()


def test_requeue_gives_fresh_attempts_and_keeps_emitted_tokens(redis_settings, rclient, keys):
    dead_letter_one(redis_settings, rclient, keys)
    assert RequestMeta.from_hash(rclient.hgetall(keys.meta("p"))).status is RequestStatus.FAILED
    assert requeue_dead(rclient, keys, [], ttl_s=60) == 1
    assert rclient.xlen(keys.dead_letters()) == 0
    meta = RequestMeta.from_hash(rclient.hgetall(keys.meta("p")))
    assert meta.status is RequestStatus.QUEUED and meta.error is None
    again = from_entry(GenerateRequest, rclient.xrange(keys.requests())[-1][1])
    assert again.attempt == 0 and again.resume_ids == [42]
    assert all(parse_run(f).token_ids for _, f in rclient.xrange(keys.chunks("p")))  # the end chunk went


@pytest.mark.parametrize("action", [["list"], []], ids=["list", "the-default"])
def test_cli_lists_dead_letters(redis_settings, rclient, keys, action):
    dead_letter_one(redis_settings, rclient, keys)
    # A hand-written entry (a red team's): the tool raised on it and listed nothing until it went.
    rclient.xadd(keys.dead_letters(), {"msg": "x", "reason": "by hand", "failed_ms": "notanint"})
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightq.cli",
            "dead-letters",
            *action,  # none: list (it said "entry_ids is required")
            "--redis_url",
            redis_settings.url,
            "--redis_key_prefix",
            redis_settings.key_prefix,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "p" in out.stdout and "died" in out.stdout and "by hand" in out.stdout


def test_an_unreadable_ingress_entry_is_parked_with_its_fields(redis_settings, rclient, keys):
    router = Router(RouterSettings(redis=redis_settings, poll_ms=10), rclient, "r1")
    rclient.xadd(keys.requests(), {"msg": "not json"})
    router.step()
    [(entry_id, fields)] = rclient.xrange(keys.dead_letters())
    letter = from_entry(DeadLetter, fields)
    assert letter.request is None and letter.raw == {"msg": "not json"} and letter.reason.startswith("unreadable")
    assert requeue_dead(rclient, keys, [], ttl_s=60) == 0  # nothing to send back: it stays for inspection
    assert list_dead(rclient, keys) == [(entry_id, letter)]


def test_entries_written_before_dead_letters_were_typed_still_read(rclient, keys):
    request = GenerateRequest(id="old", prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=4), created_ms=0)
    rclient.xadd(keys.dead_letters(), {**entry(request), "reason": "its worker died", "failed_ms": "7"})
    rclient.xadd(keys.dead_letters(), {"msg": "garbage", "reason": "unreadable: x"})
    [(_, parked), (_, unreadable)] = list_dead(rclient, keys)
    assert parked == DeadLetter(reason="its worker died", failed_ms=7, request=request)
    assert unreadable == DeadLetter(reason="unreadable: x", failed_ms=0, raw={"msg": "garbage"})
    assert requeue_dead(rclient, keys, [], ttl_s=60) == 1
    assert from_entry(GenerateRequest, rclient.xrange(keys.requests())[-1][1]).id == "old"

"""The worker's intake thread against a real Redis: it outlives what a reap does to its inbox."""

from __future__ import annotations

import time

from shared.codec import entry
from shared.schemas import GenerateRequest, SamplingParams
from tests.waiting import MUST_HAPPEN_S
from worker.service.intake import Intake


def request(request_id: str) -> GenerateRequest:
    return GenerateRequest(id=request_id, prompt_ids=[1], created_ms=0, params=SamplingParams(max_new_tokens=2))


def arrived(intake: Intake, request_id: str) -> bool:
    deadline = time.monotonic() + MUST_HAPPEN_S
    while time.monotonic() < deadline:
        for found in intake.take(wait_s=0.2):
            if any(r.id == request_id for _, r, _ in found.entries):
                return True
    return False


def test_the_intake_reads_on_after_its_inbox_is_deleted_under_its_blocked_read(rclient, keys):
    """A router that reaped this worker while it was cut off deletes its inbox: the blocked XREADGROUP
    ends UNBLOCKED. The intake makes its group again and reads what comes next (it used to die, and
    the worker went on beating with nobody reading its inbox)."""
    intake = Intake(rclient, keys, "w1", held=list, history=lambda: (10, 60.0))
    intake.start()
    try:
        rclient.xadd(keys.inbox("w1"), entry(request("first")))
        assert arrived(intake, "first")
        time.sleep(0.3)  # blocked in its next read
        rclient.delete(keys.inbox("w1"))
        rclient.xadd(keys.inbox("w1"), entry(request("after")))
        assert arrived(intake, "after") and intake.thread is not None and intake.thread.is_alive()
    finally:
        intake.stop()
        rclient.delete(keys.inbox("w1"), keys.output_lengths())


def test_the_lora_registry_is_handed_over_when_it_changes(rclient, keys):
    """Read inline (no thread): the registry once per change, an unchanged one not again, a deleted
    key as an empty registry (every run-time adapter goes)."""
    from shared.codec import encode
    from shared.lora import LoraRegistry

    key = keys.lora_registry("m")
    intake = Intake(rclient, keys, "w1", held=list, history=lambda: (10, 60.0), lora_key=key)

    def read() -> LoraRegistry | None:
        intake.next_lora = 0.0  # due now: the period is not what is tested
        return intake.read(block_ms=None).lora

    try:
        assert read() is None  # no key, nothing handed over yet: nothing to reconcile
        registry = LoraRegistry(version=1, adapters={"sql": "/a/sql"})
        rclient.set(key, encode(registry))
        assert read() == registry
        assert read() is None
        rclient.delete(key)
        assert read() == LoraRegistry()
    finally:
        rclient.delete(key, keys.inbox("w1"), keys.output_lengths())

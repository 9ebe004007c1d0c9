"""A draining worker hands back at once what never started here (real Redis, counting model)."""

from __future__ import annotations

import torch

from shared import ingress
from shared.admission import AdmissionRule
from shared.codec import entry, from_entry
from shared.config import AdmissionSettings, ModelSettings
from shared.keys import WORKER_GROUP
from shared.redis import ensure_group
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_settings import WorkerSettings
from worker.engine.engine import Engine, EngineLimits
from worker.engine.token_pool import TokenPool
from worker.model.counting_model import CountingModel
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable
from worker.service.publisher_process import PublisherLink
from worker.service.serve import WorkerService

SLOTS = 4096


def counting_engine(running_max: int) -> Engine:
    cpu = torch.device("cpu")
    runner = ModelRunner(
        CountingModel(256, cpu), TokenPool(SLOTS), ReqTable(running_max, 512, SLOTS, cpu), 256, cpu, set(), None
    )
    return Engine(
        runner,
        EngineLimits(SLOTS, 1024, running_max),
        set(),
        AdmissionRule(AdmissionSettings(admission="conservative")),
    )


def send(rclient, keys, worker_id: str, request_id: str) -> None:
    msg = GenerateRequest(
        id=request_id, prompt_ids=[7] * 8, created_ms=0, params=SamplingParams(max_new_tokens=400, ignore_eos=True)
    )
    rclient.hset(keys.meta(request_id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, created_ms=0))
    rclient.xadd(keys.inbox(worker_id), entry(msg))


def test_drain_requeues_the_unstarted_and_the_unread_at_once_and_keeps_the_running(
    redis_settings, rclient, keys, smollm2_tokenizer_dir
):
    worker_id = "drain-w"
    ensure_group(rclient, keys.inbox(worker_id), WORKER_GROUP)
    ensure_group(rclient, keys.requests(), "routers")
    # The model is the counting one built above; the publisher process only needs a tokenizer:
    # SmolLM2's (what "counting" loads) from a directory, in a fraction of the time (tests/conftest.py).
    model = ModelSettings(model_dir=smollm2_tokenizer_dir)
    settings = WorkerSettings(redis=redis_settings, model=model, drain_timeout=0.2)
    publisher = PublisherLink(settings, worker_id)
    publisher.start()
    service = WorkerService(settings, rclient, counting_engine(running_max=1), worker_id, publisher)
    for i in range(3):
        send(rclient, keys, worker_id, f"r{i}")
    service._serve_once()  # its own pending entries first (none)
    service._serve_once()  # reads all three; r0 runs, r1 and r2 wait (one may run at a time)
    send(rclient, keys, worker_id, "r3")  # dispatched after that read: never read here
    assert [r.id for r in service.engine.running] == ["r0"]
    service._drain()  # r0 keeps running for drain_timeout (it needs 400 steps); the rest goes back first
    requeued = [from_entry(GenerateRequest, f).id for _, f in ingress.entries(rclient, keys)]
    assert sorted(requeued) == ["r1", "r2", "r3"]
    assert [from_entry(GenerateRequest, f).id for _, f in rclient.xrange(keys.inbox(worker_id))] == ["r0"]
    assert not service.engine.waiting
    assert all(rclient.hget(keys.meta(f"r{i}"), "status") == "queued" for i in (1, 2, 3))
    publisher.close()

"""What a worker cannot run ends with an error the producer answers with a 400 (``failure``), not a
500: a constraint on a worker that applies no grammars (the counting stand-in: a red-team probe got
500 ``generation_failed``), a request over this worker's pool (the router's check missed it: an older
record). Real Redis, the counting model, the publisher process."""

from __future__ import annotations

import time

from producer.api.structured import failure
from shared.chunks import emitted_chunks
from shared.codec import entry
from shared.config import ModelSettings
from shared.keys import WORKER_GROUP
from shared.redis import ensure_group
from shared.schemas import Constraint, GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.waiting import MUST_HAPPEN_S
from tests.worker.test_drain import SLOTS, counting_engine
from worker.service.publisher_process import PublisherLink
from worker.service.serve import WorkerService


def send(rclient, keys, worker_id: str, msg: GenerateRequest) -> None:
    rclient.hset(keys.meta(msg.id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, created_ms=0))
    rclient.xadd(keys.inbox(worker_id), entry(msg))


def test_what_this_worker_cannot_run_is_the_clients_400(redis_settings, rclient, keys, smollm2_tokenizer_dir):
    worker_id = "refusing-w"
    ensure_group(rclient, keys.inbox(worker_id), WORKER_GROUP)
    settings = WorkerSettings(redis=redis_settings, model=ModelSettings(model_dir=smollm2_tokenizer_dir))
    publisher = PublisherLink(settings, worker_id)
    publisher.start()
    try:
        service = WorkerService(settings, rclient, counting_engine(running_max=4), worker_id, publisher)
        json = Constraint(kind="json")
        send(
            rclient,
            keys,
            worker_id,
            GenerateRequest(
                id="json", prompt_ids=[7] * 8, created_ms=0, params=SamplingParams(max_new_tokens=4, constraint=json)
            ),
        )
        huge = SamplingParams(max_new_tokens=SLOTS, ignore_eos=True)
        send(rclient, keys, worker_id, GenerateRequest(id="huge", prompt_ids=[7] * 8, created_ms=0, params=huge))
        service._serve_once()
        service._serve_once()
        answers = {}
        for request_id in ("json", "huge"):
            deadline = time.monotonic() + MUST_HAPPEN_S  # the publisher process writes the ends
            while not (chunks := emitted_chunks(rclient, keys, request_id)) and time.monotonic() < deadline:
                time.sleep(0.05)
            last = chunks[-1]
            assert last.finish_reason == "error", last
            answers[request_id] = failure(last.error)
        assert answers["json"].status == 400 and answers["json"].detail.code == Constraint.UNSUPPORTED
        assert answers["huge"].status == 400 and answers["huge"].detail.code == "request_too_large"
        assert f"holds {SLOTS}" in answers["huge"].detail.message
    finally:
        publisher.close()

"""A queued request whose LoRA adapter is unloaded before it starts ends at once with the
``model_not_found`` error (the producer's 404), not at its timeout (``router.lora.adapter_gone``); while a worker
may still list the adapter (just loaded, or no worker up yet) it waits. One that started before the
unload and had to move brings the adapter's folder to a worker that can load it."""

from __future__ import annotations

from producer.api.structured import failure
from shared import ingress
from shared.chunks import emitted_chunks
from shared.codec import decode, encode
from shared.lora import LoraRegistry, gone_error
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_load import WorkerLoad
from tests.router.helpers import inbox_ids, publish_load
from tests.router.test_loop import make_router

MODEL = "m"


def worker(rclient, keys, worker_id: str, adapters: list[str], **more) -> None:
    publish_load(rclient, keys, worker_id, model=MODEL)
    load = decode(WorkerLoad, rclient.get(keys.load(worker_id)))
    rclient.set(keys.load(worker_id), encode(load.model_copy(update={"adapters": adapters, **more})), px=5000)


def registry(rclient, keys, *names: str) -> None:
    rclient.set(keys.lora_registry(MODEL), encode(LoraRegistry(version=1, adapters={n: f"/a/{n}" for n in names})))


def submit(
    rclient, keys, request_id: str, adapter: str, resume_ids: tuple[int, ...] = (), path: str | None = None
) -> None:
    msg = GenerateRequest(
        id=request_id,
        prompt_ids=list(range(1, 11)),
        model=MODEL,
        adapter=adapter,
        adapter_path=path,
        params=SamplingParams(max_new_tokens=4),
        created_ms=now_ms(),
        resume_ids=list(resume_ids),
    )
    rclient.hset(keys.meta(request_id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, created_ms=now_ms()))
    pipe = rclient.pipeline(transaction=True)
    ingress.add(pipe, keys, msg)
    pipe.execute()


def status(rclient, keys, request_id: str) -> RequestStatus:
    return RequestMeta.from_hash(rclient.hgetall(keys.meta(request_id))).status


def test_a_queued_request_for_an_unloaded_adapter_ends_at_once(redis_settings, rclient, keys):
    worker(rclient, keys, "w1", ["poems"])  # sql was unloaded: the worker dropped it, the registry too
    registry(rclient, keys, "poems")
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "gone", "sql")
    submit(rclient, keys, "behind", "poems")
    router.step()
    assert status(rclient, keys, "gone") is RequestStatus.FAILED
    last = emitted_chunks(rclient, keys, "gone")[-1]
    assert last.finish_reason == "error" and last.error == gone_error("sql")
    assert inbox_ids(rclient, keys, "w1") == ["behind"]  # the queue behind it moves on
    answer = failure(last.error)  # what the producer tells the client
    assert answer.status == 404 and answer.detail.code == "model_not_found" and "'sql'" in answer.detail.message


def test_a_moved_request_whose_adapter_was_unloaded_says_so(redis_settings, rclient, keys):
    """Unloaded while it ran, then its worker died: back in the queue with its tokens, it finds the
    adapter on no worker, and its error says that, not "unloaded before the request started" (red team 7)."""
    worker(rclient, keys, "w1", ["poems"])
    registry(rclient, keys, "poems")
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "moved", "sql", resume_ids=(5, 6))
    router.step()
    last = emitted_chunks(rclient, keys, "moved")[-1]
    assert last.error == gone_error("sql", started=True) and "while this request ran" in last.error
    assert failure(last.error).status == 404


def test_a_moved_request_brings_its_unloaded_adapter_to_a_worker_that_can_load_it(redis_settings, rclient, keys):
    """Unloaded while it ran, then its worker died: it carries the adapter's folder, so a worker with
    run-time slots takes it though none lists the adapter (the one still holding it first: it pages
    nothing in); one that never started, though it carries the folder too, ends as before."""
    worker(rclient, keys, "w1", ["poems"], adopts_adapters=True)
    worker(rclient, keys, "w2", ["poems"], adopts_adapters=True, resident_adapters=["sql"])  # retiring there
    worker(rclient, keys, "w3", ["poems"])  # no run-time slots
    registry(rclient, keys, "poems")
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "moved", "sql", resume_ids=(5, 6), path="/a/sql")
    submit(rclient, keys, "queued", "sql", path="/a/sql")
    router.step()
    assert inbox_ids(rclient, keys, "w2") == ["moved"] and inbox_ids(rclient, keys, "w1") == []
    assert status(rclient, keys, "queued") is RequestStatus.FAILED
    assert emitted_chunks(rclient, keys, "queued")[-1].error == gone_error("sql")


def test_it_waits_while_the_adapter_may_still_come(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "early", "sql")
    router.step()  # no worker of the model up yet: it waits for them
    assert status(rclient, keys, "early") is RequestStatus.QUEUED
    worker(rclient, keys, "w1", [])
    registry(rclient, keys, "sql")  # just loaded: recorded, no worker lists it yet
    router.step()
    assert status(rclient, keys, "early") is RequestStatus.QUEUED
    worker(rclient, keys, "w1", ["sql"])
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["early"]


def test_it_ends_when_every_worker_failed_to_load_it(redis_settings, rclient, keys):
    worker(rclient, keys, "w1", [])
    load = decode(WorkerLoad, rclient.get(keys.load("w1")))
    failed = load.model_copy(update={"lora_failed": [("sql", "/a/sql", "shapes do not fit")]})
    rclient.set(keys.load("w1"), encode(failed), px=5000)
    registry(rclient, keys, "sql")
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "q", "sql")
    router.step()
    assert status(rclient, keys, "q") is RequestStatus.FAILED

"""Plays the workers' side of the protocol against the real Redis."""

from __future__ import annotations

from shared import ingress
from shared.codec import encode
from shared.keys import Keys
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_load import WorkerLoad


def publish_load(
    client,
    keys: Keys,
    worker_id: str,
    max_total: int = 1000,
    committed: int = 0,
    last_inbox_id: str = "0-0",
    ttl_ms: int = 5000,
    requests: list | None = None,
    running_max: int | None = None,
    age_ms: int = 0,
    model: str | None = None,
    admission_limit: int | None = None,
) -> None:
    """A worker's record; without ``requests``, one request holding ``committed`` tokens with
    nothing left to add (so every policy projects ``committed``)."""
    if requests is None:
        requests = [(committed, 0, 0, 0)] if committed else []
    committed = sum(held - done + max_new for held, done, max_new, _ in requests)
    load = WorkerLoad(
        worker_id=worker_id,
        seq=1,
        ts_ms=now_ms() - age_ms,
        max_total_tokens=max_total,
        used_tokens=0,
        committed_tokens=committed,
        num_running=len(requests),
        num_waiting=0,
        last_inbox_id=last_inbox_id,
        running_max_req_size=running_max,
        admission_limit=admission_limit,
        model=model,
        requests=[tuple(r) for r in requests],
    )
    client.set(keys.load(worker_id), encode(load), px=ttl_ms)
    client.zadd(keys.workers(), {worker_id: now_ms()})


def submit(
    client,
    keys: Keys,
    request_id: str,
    prompt_len: int = 10,
    max_new: int = 10,
    ignore_eos: bool = False,
    model: str | None = None,
    n: int = 1,
    priority: int = 0,
    tenant: str = "default",
    deadline_ms: int | None = None,
) -> GenerateRequest:
    msg = GenerateRequest(
        deadline_ms=deadline_ms,
        id=request_id,
        prompt_ids=list(range(1, prompt_len + 1)),
        model=model,
        n=n,
        priority=priority,
        tenant=tenant,
        params=SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos),
        created_ms=now_ms(),
    )
    client.hset(keys.meta(request_id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, created_ms=now_ms()))
    pipe = client.pipeline(transaction=True)
    ingress.add(pipe, keys, msg)  # its class's stream, as the producer writes it
    pipe.execute()
    return msg


def inbox_ids(client, keys: Keys, worker_id: str) -> list[str]:
    from shared.codec import from_entry

    return [from_entry(GenerateRequest, f).id for _, f in client.xrange(keys.inbox(worker_id))]


def finished_lengths(client, keys: Keys, lengths: list[int]) -> None:
    """What workers' publishers do as requests finish: newest first on a capped list."""
    for n in lengths:
        client.lpush(keys.output_lengths(), n)


def start_on(client, keys: Keys, request_id: str, worker_id: str) -> None:
    """The worker's start write (``running``, its id, a step time): a death of the worker is then
    blamed on the request (``router.workers.janitor.last_admission``)."""
    fields = RequestMeta.fields(status=RequestStatus.RUNNING, worker=worker_id, stepped_ms=now_ms())
    client.hset(keys.meta(request_id), mapping=fields)

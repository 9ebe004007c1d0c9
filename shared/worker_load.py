"""A worker's load record and the router's preemption ask, serialised as JSON by ``shared.codec``.

worker --WorkerLoad--> {q}:w:ID:load (heartbeat with TTL)
router --PreemptAsk--> {q}:w:ID:preempt --> worker
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import Field, model_validator

from shared.schemas import FrozenModel, GenerateRequest


class WorkerLoad(FrozenModel):
    """A worker's heartbeat: enough for the router's admission check."""

    kind: Literal["load"] = "load"
    worker_id: str
    seq: int
    ts_ms: int
    max_total_tokens: int
    used_tokens: int
    committed_tokens: int = Field(description="sum of prompt + max_new_tokens over running and waiting requests")
    num_running: int
    num_waiting: int
    last_inbox_id: str = Field("0-0", description="newest inbox entry the worker has taken in")
    draining: bool = False
    model: str | None = Field(None, description="the served model name (None: takes any request)")
    running_max_req_size: int | None = Field(None, description="most requests the worker runs at once")
    admission_limit: int | None = Field(
        None,
        description="KV tokens one request's samples may need and surely start on this worker alone: its pool "
        "less what the admission policy keeps free (--admission_margin); None: the whole pool (an older worker)",
    )
    adapters: list[str] = Field(
        default_factory=list, description="the LoRA adapters new requests may name here (--lora_modules', run-time)"
    )
    resident_adapters: list[str] = Field(
        default_factory=list, description="the LoRA adapters in device memory now (unloaded ones still in use too)"
    )
    lora_failed: list[tuple[str, str, str]] = Field(
        default_factory=list, description="run-time LoRA adapters this worker could not load: [name, folder, why]"
    )
    adopts_adapters: bool = Field(
        False,
        description="it has run-time LoRA slots: a started request whose adapter was unloaded (no worker "
        "lists it) may move here, bringing the folder (GenerateRequest.brings_adapter)",
    )
    requests: list[tuple[int, int, int, int]] = Field(
        description="per running or waiting request: [prompt + output tokens, output tokens, "
        "max_new_tokens, ignore_eos 0/1] (shared.peak.ReqState), a group's prompt counted once"
    )
    prefix_cache: bool = Field(False, description="the worker keeps a prefix cache (off: --no-prefix_cache)")
    cached_tokens: int = Field(0, description="tokens the prefix cache holds (0: off)")
    prefixes: list[tuple[int, int]] = Field(
        default_factory=list,
        description="what the prefix cache holds, bounded: [prefix hash, tokens it covers] "
        "(shared.prefix_hash), the most recently used first",
    )
    held_prefixes: list[int] = Field(
        default_factory=list,
        description="indexes into prefixes of the entries whose tokens running requests hold (counted "
        "in requests): a request starting with one adds only the rest here (router.admission.worker_view); the "
        "other entries are evictable, and a request that hits them holds them again",
    )
    prefix_asked_tokens: int = Field(0, description="tokens of admitted requests looked up in the cache, since start")
    prefix_hit_tokens: int = Field(0, description="of those, tokens found cached (not prefilled)")
    prefix_evicted_tokens: int = Field(0, description="cached tokens evicted to make room, since start")

    preemptible: list[tuple[int, int, int]] = Field(
        default_factory=list,
        description="per priority class with requests this worker would pause for a better class "
        "(worker.engine.preempt): [priority, tokens they hold, request slots (a group's samples each)], "
        "the worst (largest) class first",
    )
    max_preemptions: int = Field(0, description="times this worker pauses one request at most (--max_preemptions)")
    preempt_asks_read: int = Field(
        0, description="preemption asks the worker has read and answered (a router waits for its own)"
    )
    preempted_requests: int = Field(0, description="started requests paused for a better class, since start")
    preempted_kv_tokens: int = Field(0, description="their K/V tokens, computed again on resume (the cost)")

    def serves(self, model: str | None, adapter: str | None = None) -> bool:
        """Whether a request for ``model`` (and LoRA ``adapter``) may come here: one pool per served
        model name, and an adapter only where the worker has loaded it."""
        if adapter is not None and adapter not in self.adapters:
            return False
        return model is None or self.model is None or self.model == model

    def adopts(self, request: GenerateRequest) -> bool:
        """Whether ``request``, which no worker lists the adapter of, may move here: it brings its
        adapter (it started before an unload) and this worker of its model can load it."""
        return request.brings_adapter and self.adopts_adapters and self.serves(request.model)

    def takes(self, model: str | None, adapter: str | None = None) -> bool:
        """Whether new requests for ``model`` (and ``adapter``) may start here: it serves them and is
        not draining."""
        return self.serves(model, adapter) and not self.draining


TOO_LARGE = "request_too_large"  # the error code of a request no worker could ever take


def too_large_error(why: str) -> str:
    """The error a queued request ends with when no live worker could ever start it (``router.loop``)."""
    return f"{TOO_LARGE}: {why}"


def is_too_large(error: str | None) -> bool:
    return (error or "").startswith(f"{TOO_LARGE}: ")


def misfit(request: GenerateRequest, loads: list[WorkerLoad]) -> str | None:
    """Why no worker of ``loads`` serving ``request`` could ever take it, or None: one could, or
    none serves it (nothing is known yet). The producer's check before a request is written
    (``producer.edge.pool_fit``) and the router's of a queued one (``router.loop``)."""
    ours = [load for load in loads if load.takes(request.model, request.adapter)]
    if not ours or any(fits(request, load) for load in ours):
        return None
    largest = max(ours, key=admits)
    pool, limit = largest.max_total_tokens, admits(largest)
    max_new = request.params.max_new_tokens
    if request.max_tokens_needed > limit:
        outputs = f"{request.n} samples of max_new_tokens {max_new}" if request.n > 1 else f"max_new_tokens {max_new}"
        within = f"the {pool} of the largest worker's pool" + (
            f" less the share admission keeps free ({limit})" if limit < pool else ""
        )
        return (
            f"this request can need {request.max_tokens_needed} KV tokens (a prompt of {request.num_prompt_tokens} "
            f"tokens and {outputs}), over {within}: lower max_tokens" + (" or n" if request.n > 1 else "")
        )
    most = max(load.running_max_req_size or 0 for load in ours)
    return f"its {request.n} samples run together, and a worker here runs at most {most} requests at once: lower n"


def admits(load: WorkerLoad) -> int:
    """The KV tokens one request may need on ``load``'s worker and surely start there alone. A
    request between this and the pool started only if the output-length history said it would
    end early: it passed the producer's check and then failed in the router (red team 3)."""
    return load.max_total_tokens if load.admission_limit is None else load.admission_limit


def fits(request: GenerateRequest, load: WorkerLoad) -> bool:
    """Whether ``request`` fits ``load``'s worker with nothing else running there."""
    most = load.running_max_req_size
    return request.max_tokens_needed <= admits(load) and (most is None or request.n <= most)


class PreemptAsk(FrozenModel):
    """A router's ask to a worker ({q}:w:ID:preempt): pause enough requests of a class worse than
    ``priority`` that the requests ``request_ids`` fit, as many of them as can, the first first,
    and hand them back to the queue (worker.engine.preempt). ``states``: their
    ``shared.peak.ReqState`` summaries, ``sizes[i]`` of them for the i-th request. The router
    dispatches them to the worker with the ask, so they may be in its queue already."""

    kind: Literal["preempt"] = "preempt"
    request_ids: list[str] = Field(min_length=1)
    priority: int
    states: list[tuple[int, int, int, int]]
    sizes: list[int]
    asked_ms: int

    @classmethod
    def for_requests(
        cls, request_ids: list[str], priority: int, states: Sequence[Sequence[tuple[int, int, int, int]]], asked_ms: int
    ) -> PreemptAsk:
        """An ask for ``request_ids``, ``states[i]`` the i-th one's states (``shared.admission.request_states``)."""
        return cls(
            request_ids=request_ids,
            priority=priority,
            states=[tuple(s) for each in states for s in each],
            sizes=[len(each) for each in states],
            asked_ms=asked_ms,
        )

    @model_validator(mode="after")
    def _check_sizes(self) -> PreemptAsk:
        if len(self.sizes) != len(self.request_ids) or sum(self.sizes) != len(self.states):
            raise ValueError("sizes: one per request, adding up to the states")
        return self


def tally_preemptible(items: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``WorkerLoad.preemptible`` from (priority, tokens, requests) items: summed per class, the
    worst (largest) class first."""
    held: dict[int, tuple[int, int]] = {}
    for priority, tokens, count in items:
        total, requests = held.get(priority, (0, 0))
        held[priority] = (total + tokens, requests + count)
    return [(p, tokens, count) for p, (tokens, count) in sorted(held.items(), reverse=True)]


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a comparable (milliseconds, sequence) pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)

"""Every Redis key, stream, group and channel name lightq uses, built in one place.

Braces are Redis Cluster hash tags, and they split the keys in two planes:

- **Control** (``{q}``): the queue, the workers' records and inboxes, the order, the requests'
  status hashes and cancel keys. Every script of the router, the producer's enqueue and the
  requeues touches several of these at once, so they share one slot (on a cluster: one primary).
  Their work is per request, not per token.
- **Data** (``{rN-K}``): a request's chunk stream, its channel and its data fence, in one of
  ``GROUPS`` request groups (``group(id)``, crc32 of the id). A publisher's flush writes each group's
  requests in one script; the groups' tags are picked so that a cluster whose primaries own equal
  slot ranges (what ``redis-cli --cluster create`` makes) holds an equal share of them on each
  primary, for 1, 2, 3, 4, 6, 8, 12 or 24 primaries. The per-token work is here.

Wake streams (``{pw:ID}``), rate-limit counters (``{k:HASH}``) and batches (``{b:ID}``) are keys
of their own slots. One layout for one node and a cluster: a single server holds both planes.

| key                         | type          | writer -> reader          |
|-----------------------------|---------------|---------------------------|
| P:{q}:requests[:PRIORITY]   | stream        | producer -> routers (one per class; class 0: no suffix) |
| P:{q}:classes               | sorted set    | producer, requeues -> routers, monitors (classes with a stream) |
| P:{q}:dead                  | stream        | router -> operators       |
| P:{q}:workers               | sorted set    | worker -> router (score = last seen ms) |
| P:{q}:w:ID:load             | string + TTL  | worker -> router, producer (WorkerLoad JSON) |
| P:{q}:w:ID:inbox            | stream        | router -> worker; routers (its entries past the load's last_inbox_id) |
| P:{q}:w:ID:preempt          | list + TTL    | router -> worker (PreemptAsk JSON; the worker reads and deletes it) |
| P:{q}:r:ID:meta             | hash + TTL    | producer, router, worker -> producer (``epoch``: shared.request_log) |
| P:{rN-K}:ID:chunks          | stream + TTL  | worker -> producer (durable chunk log: a ChunkRun an entry) |
| P:{rN-K}:ID:tokens          | pub/sub       | worker -> anyone (live runs, where someone listens) |
| P:{q}:r:ID:cancel           | string + TTL  | producer -> router, worker |
| P:{pw:ID}:wake              | stream + TTL  | worker -> producer ID (ids of requests with new chunks) |
| P:{q}:outlen                | capped list   | worker -> router (finished output lengths) |
| P:{q}:enqueued_tokens       | counter       | producer (cost ever enqueued; an ingress entry has the sum before it) |
| P:{k:HASH}:rpm:MINUTE       | counter + TTL | producer (requests of one API key in one minute) |
| P:{q}:w:ID:reap             | string + TTL  | router lock while re-dispatching a dead worker's requests |
| P:{rN-K}:ID:fence           | string + TTL  | fences (shared.request_log) -> flushes (an epoch a write must pass) |
| P:{q}:rt:ID:alive           | string + TTL  | router liveness; when gone, other routers claim its pending entries |
| P:{b:ID}:batch              | hash + TTL    | producer, rq batch job -> producer (batch status and counts) |
| P:{b:ID}:input              | string + TTL  | producer -> rq batch job (the JSONL as submitted) |
| P:{b:ID}:inflight           | hash + TTL    | rq batch job (line -> request id, while it runs) |
| P:{b:ID}:results            | hash + TTL    | rq batch job (line -> output line, until the output is written) |
| P:{b:ID}:output             | string + TTL  | rq batch job -> producer (the output JSONL) |
| P:batches:OWNER             | zset          | producer (an owner's batch ids by creation time; expired ones pruned) |
| P:housekeeping:cursor[:N]   | string        | rq housekeeping (SCAN cursor of the sweep; a cluster: one a primary) |
| P:{q}:m:MODEL:waiting       | sorted set    | routers -> routers, producer (request id -> priority, while queued) |
| P:{q}:p:PRIO:order          | sorted set    | routers -> routers, producer (request id -> virtual start tag) |
| P:{q}:p:PRIO:vtc            | hash          | routers (tenant -> virtual finish tag in the class) |
| P:{q}:vtime                 | hash          | routers (class -> virtual time: the largest tag dispatched) |
| P:{q}:tenant_queued         | hash          | routers -> metrics ("PRIO:tenant" -> requests queued) |
| P:{q}:tenant_served         | hash          | routers -> metrics ("PRIO:tenant" -> tokens dispatched) |
| P:{q}:router_decisions      | hash          | routers -> producer (reason -> admission decisions, every router's) |
| P:{q}:m:MODEL:lora          | string        | producer -> workers, producers (run-time adapters: shared.lora) |

Routers read a worker's inbox past its load's ``last_inbox_id``: dispatches the load does not show yet.
Expired batch ids leave an owner's zset when the owner's batches are listed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

ROUTER_GROUP = "routers"
WORKER_GROUP = "worker"


GROUPS = 24  # request groups of the data plane: a multiple of every primary count it spreads evenly over
FENCE_TTL_S = 7 * 24 * 3600  # a data fence outlives any request record (shared.request_log)


def _group_tags() -> tuple[str, ...]:
    """Group n's tag is the first ``rN-K`` whose slot lies in the n-th of ``GROUPS`` equal slot
    ranges: a cluster of P primaries with equal contiguous ranges (P dividing GROUPS) then holds
    GROUPS / P groups on each."""
    tags = []
    for n in range(GROUPS):
        low, high = n * REDIS_CLUSTER_HASH_SLOTS // GROUPS, (n + 1) * REDIS_CLUSTER_HASH_SLOTS // GROUPS
        k = 0
        while not low <= key_slot(f"r{n}-{k}".encode()) < high:
            k += 1
        tags.append(f"r{n}-{k}")
    return tuple(tags)


GROUP_TAGS = _group_tags()


def group(request_id: str) -> int:
    """The request group of an id (stable across processes and languages: CRC-32 of its UTF-8)."""
    return zlib.crc32(request_id.encode()) % GROUPS


def class_tenant_field(priority: int, tenant: str) -> str:
    """A field of ``tenant_queued`` and ``tenant_served``: priority first, so a ':' in a tenant parses."""
    return f"{priority}:{tenant}"


def split_class_tenant_field(field: str) -> tuple[int, str]:
    priority, _, tenant = field.partition(":")
    return int(priority), tenant


@dataclass(frozen=True)
class Keys:
    prefix: str = "lightq"

    def requests(self, priority: int = 0) -> str:
        """The ingress stream of one priority class (``shared.ingress``): the default class keeps
        the plain name, so a deployment without priorities has the one stream it always had."""
        base = f"{self.prefix}:{{q}}:requests"
        return base if priority == 0 else f"{base}:{priority}"

    def classes(self) -> str:
        """Sorted set of the priority classes that have an ingress stream (member and score: the class)."""
        return f"{self.prefix}:{{q}}:classes"

    def dead_letters(self) -> str:
        return f"{self.prefix}:{{q}}:dead"

    def workers(self) -> str:
        return f"{self.prefix}:{{q}}:workers"

    def load(self, worker_id: str) -> str:
        return f"{self.prefix}:{{q}}:w:{worker_id}:load"

    def inbox(self, worker_id: str) -> str:
        return f"{self.prefix}:{{q}}:w:{worker_id}:inbox"

    def preempt(self, worker_id: str) -> str:
        return f"{self.prefix}:{{q}}:w:{worker_id}:preempt"

    def meta(self, request_id: str) -> str:
        return f"{self.prefix}:{{q}}:r:{request_id}:meta"

    def data_tag(self, request_id: str) -> str:
        """The hash tag of a request's data plane (its group's)."""
        return GROUP_TAGS[group(request_id)]

    def chunks(self, request_id: str) -> str:
        return f"{self.prefix}:{{{self.data_tag(request_id)}}}:{request_id}:chunks"

    def channel(self, request_id: str) -> str:
        return f"{self.prefix}:{{{self.data_tag(request_id)}}}:{request_id}:tokens"

    def channels(self) -> str:
        """The pattern of every request's channel (PSUBSCRIBE; one server only: a cluster's channels
        are sharded, and SSUBSCRIBE takes no pattern)."""
        return f"{self.prefix}:{{r*}}:*:tokens"

    def data_fence(self, request_id: str) -> str:
        """The epoch a data write must be past: a fence raises it before the chunks it reads are final."""
        return f"{self.prefix}:{{{self.data_tag(request_id)}}}:{request_id}:fence"

    def wake(self, producer_id: str) -> str:
        """A producer's wake stream: publishers append the ids of its requests they just wrote
        (``producer.streams.stream_hub`` reads only those streams)."""
        return f"{self.prefix}:{{pw:{producer_id}}}:wake"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}:{{q}}:r:{request_id}:cancel"

    def reap_lock(self, worker_id: str) -> str:
        return f"{self.prefix}:{{q}}:w:{worker_id}:reap"

    def router_alive(self, router_id: str) -> str:
        return f"{self.prefix}:{{q}}:rt:{router_id}:alive"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:batch"

    def batch_input(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:input"

    def batch_inflight(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:inflight"

    def batch_results(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:results"

    def batch_output(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:output"

    def batch_index(self, owner: str) -> str:
        """``owner``: the API key's hash, or ``open`` when keys are off."""
        return f"{self.prefix}:batches:{owner}"

    def all_batch_keys(self, batch_id: str) -> list[str]:
        return [
            self.batch(batch_id),
            self.batch_input(batch_id),
            self.batch_inflight(batch_id),
            self.batch_results(batch_id),
            self.batch_output(batch_id),
        ]

    def housekeeping_cursor(self, node: int = 0) -> str:
        """The sweep's SCAN cursor on one server (``node``: a cluster primary's place in its list)."""
        return f"{self.prefix}:housekeeping:cursor" + (f":{node}" if node else "")

    def enqueued_tokens(self) -> str:
        return f"{self.prefix}:{{q}}:enqueued_tokens"

    def waiting(self, model: str | None) -> str:
        """Queued requests for one served model (tagged by a router) scored by priority: the class
        check of every dispatch. Per model: a request only its model's workers take never holds
        up another model's lower classes. (``{m}``: requests for any worker, ``model`` None.)"""
        return f"{self.prefix}:{{q}}:m:{model}:waiting" if model else f"{self.prefix}:{{q}}:m:waiting"

    def lora_registry(self, model: str | None) -> str:
        """The LoRA adapters loaded at run time for one served model (``shared.lora.LoraRegistry``):
        no TTL, the record every worker of the model reconciles against, one started later too."""
        return f"{self.prefix}:{{q}}:m:{model}:lora" if model else f"{self.prefix}:{{q}}:m:lora"

    def order(self, priority: int) -> str:
        return f"{self.prefix}:{{q}}:p:{priority}:order"

    def vtc(self, priority: int) -> str:
        return f"{self.prefix}:{{q}}:p:{priority}:vtc"

    def vtime(self) -> str:
        return f"{self.prefix}:{{q}}:vtime"

    def tenant_queued(self) -> str:
        return f"{self.prefix}:{{q}}:tenant_queued"

    def tenant_served(self) -> str:
        return f"{self.prefix}:{{q}}:tenant_served"

    def router_decisions(self) -> str:
        return f"{self.prefix}:{{q}}:router_decisions"

    def rate_limit(self, key_hash: str, minute: int) -> str:
        return f"{self.prefix}:{{k:{key_hash}}}:rpm:{minute}"

    def output_lengths(self) -> str:
        return f"{self.prefix}:{{q}}:outlen"

    def control_request_keys(self, request_id: str) -> list[str]:
        """A request's keys on the control plane (one slot: one DEL, one transaction)."""
        return [self.meta(request_id), self.cancel(request_id)]

    def data_request_keys(self, request_id: str) -> list[str]:
        """A request's records on the data plane (its group's slot; the data fence has a TTL of its own)."""
        return [self.chunks(request_id)]

    def all_request_keys(self, request_id: str) -> list[str]:
        """Both planes' (two slots: a cluster client's multi-key DEL splits them)."""
        return self.control_request_keys(request_id) + self.data_request_keys(request_id)

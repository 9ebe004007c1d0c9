"""Every Redis key, stream, group and channel name lightq uses, built in one place.

Braces are Redis Cluster hash tags: keys sharing ``{r:ID}`` (or ``{w:ID}``)
land in one slot, so a request's status and chunks can be written together.

| key                         | type          | writer -> reader          |
|-----------------------------|---------------|---------------------------|
| P:{q}:requests[:PRIORITY]   | stream        | producer -> routers (one per class; class 0: no suffix) |
| P:{q}:classes               | sorted set    | producer, requeues -> routers, monitors (classes with a stream) |
| P:{q}:dead                  | stream        | router -> operators       |
| P:workers                   | sorted set    | worker -> router (score = last seen ms) |
| P:{w:ID}:load               | string + TTL  | worker -> router, producer (WorkerLoad JSON) |
| P:{w:ID}:inbox              | stream        | router -> worker; routers (its entries past the load's last_inbox_id) |
| P:{w:ID}:preempt            | list + TTL    | router -> worker (PreemptAsk JSON; the worker reads and deletes it) |
| P:{r:ID}:meta               | hash + TTL    | producer, router, worker -> producer |
| P:{r:ID}:chunks             | stream + TTL  | worker -> producer (durable chunk log) |
| P:{r:ID}:tokens             | pub/sub       | worker -> anyone (live chunks) |
| P:{r:ID}:cancel             | string + TTL  | producer -> router, worker |
| P:outlen                    | capped list   | worker -> router (finished output lengths) |
| P:{q}:enqueued_tokens       | counter       | producer (cost ever enqueued; an ingress entry has the sum before it) |
| P:{k:HASH}:rpm:MINUTE       | counter + TTL | producer (requests of one API key in one minute) |
| P:{w:ID}:reap               | string + TTL  | router lock while re-dispatching a dead worker's requests |
| P:{rt:ID}:alive             | string + TTL  | router liveness; when gone, other routers claim its pending entries |
| P:{b:ID}:batch              | hash + TTL    | producer, rq batch job -> producer (batch status and counts) |
| P:{b:ID}:input              | string + TTL  | producer -> rq batch job (the JSONL as submitted) |
| P:{b:ID}:inflight           | hash + TTL    | rq batch job (line -> request id, while it runs) |
| P:{b:ID}:results            | hash + TTL    | rq batch job (line -> output line, until the output is written) |
| P:{b:ID}:output             | string + TTL  | rq batch job -> producer (the output JSONL) |
| P:batches:OWNER             | zset          | producer (an owner's batch ids by creation time; expired ones pruned) |
| P:housekeeping:cursor       | string        | rq housekeeping (SCAN cursor of the request-record sweep) |
| P:{m:MODEL}:waiting         | sorted set    | routers -> routers, producer (request id -> priority, while queued) |
| P:{p:PRIO}:order            | sorted set    | routers -> routers, producer (request id -> virtual start tag) |
| P:{p:PRIO}:vtc              | hash          | routers (tenant -> virtual finish tag in the class) |
| P:{q}:vtime                 | hash          | routers (class -> virtual time: the largest tag dispatched) |
| P:{q}:tenant_queued         | hash          | routers -> metrics ("PRIO:tenant" -> requests queued) |
| P:{q}:tenant_served         | hash          | routers -> metrics ("PRIO:tenant" -> tokens dispatched) |
| P:{q}:router_decisions      | hash          | routers -> producer (reason -> admission decisions, every router's) |

Routers read a worker's inbox past its load's ``last_inbox_id``: dispatches the load does not show yet.
Expired batch ids leave an owner's zset when the owner's batches are listed.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTER_GROUP = "routers"
WORKER_GROUP = "worker"


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
        return f"{self.prefix}:workers"

    def load(self, worker_id: str) -> str:
        return f"{self.prefix}:{{w:{worker_id}}}:load"

    def inbox(self, worker_id: str) -> str:
        return f"{self.prefix}:{{w:{worker_id}}}:inbox"

    def preempt(self, worker_id: str) -> str:
        return f"{self.prefix}:{{w:{worker_id}}}:preempt"

    def meta(self, request_id: str) -> str:
        return f"{self.prefix}:{{r:{request_id}}}:meta"

    def chunks(self, request_id: str) -> str:
        return f"{self.prefix}:{{r:{request_id}}}:chunks"

    def channel(self, request_id: str) -> str:
        return f"{self.prefix}:{{r:{request_id}}}:tokens"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}:{{r:{request_id}}}:cancel"

    def reap_lock(self, worker_id: str) -> str:
        return f"{self.prefix}:{{w:{worker_id}}}:reap"

    def router_alive(self, router_id: str) -> str:
        return f"{self.prefix}:{{rt:{router_id}}}:alive"

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

    def housekeeping_cursor(self) -> str:
        return f"{self.prefix}:housekeeping:cursor"

    def enqueued_tokens(self) -> str:
        return f"{self.prefix}:{{q}}:enqueued_tokens"

    def waiting(self, model: str | None) -> str:
        """Queued requests for one served model (tagged by a router) scored by priority: the class
        check of every dispatch. Per model: a request only its model's workers take never holds
        up another model's lower classes. (``{m}``: requests for any worker, ``model`` None.)"""
        return f"{self.prefix}:{{m:{model}}}:waiting" if model else f"{self.prefix}:{{m}}:waiting"

    def order(self, priority: int) -> str:
        return f"{self.prefix}:{{p:{priority}}}:order"

    def vtc(self, priority: int) -> str:
        return f"{self.prefix}:{{p:{priority}}}:vtc"

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
        return f"{self.prefix}:outlen"

    def all_request_keys(self, request_id: str) -> list[str]:
        return [self.meta(request_id), self.chunks(request_id), self.cancel(request_id)]

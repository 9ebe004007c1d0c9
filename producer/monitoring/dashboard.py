"""``/dashboard``: one self-contained page (no external assets) and the JSON it polls.

``/dashboard/data`` serves the same last cluster view that ``/metrics``
renders (refreshed off the request path, ``ProducerMetrics.run``), so the
page shows the numbers a scrape would: queue depth and tokens, drain and
arrival rates, throughput, the backlog signal, each worker's load and prefix
cache (cached tokens, hit rate, evictions) and preemptions, the routers' decisions by reason, the
queue per priority class and per tenant (queued, tokens dispatched), and the
newest requests with their status and latencies (these from the request
records' own times: a display, not the histograms). The page keeps nothing
but the last answer; its plots draw the producer's own history (one point
a second, ten minutes kept). With ``--producers N`` the totals are summed
over the N processes, the history is the answering process's.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse

from producer.deps import ServicesDep
from producer.monitoring.cluster import ClusterSnapshot
from producer.monitoring.metrics import ProducerMetrics
from producer.monitoring.recent import RecentRequest

router = APIRouter()
RECENT_ROWS = 25


def page() -> str:
    return resources.files("producer.monitoring").joinpath("static/dashboard.html").read_text(encoding="utf-8")


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(page())


@router.get("/dashboard/data", responses={503: {"description": "no cluster view read yet"}})
async def dashboard_data(services: ServicesDep) -> JSONResponse:
    snap = services.metrics.snapshot
    if snap is None:  # the first refresh has not finished (or Redis has not answered yet)
        return JSONResponse({"error": "no cluster view yet"}, status_code=503)
    return JSONResponse(snapshot_json(snap, services.metrics))


def snapshot_json(snap: ClusterSnapshot, metrics: ProducerMetrics) -> dict:
    """The dashboard's numbers; each key is named after the metric it equals."""
    return {
        "ts_ms": snap.ts_ms,
        "window_s": snap.window_s,
        "queue": {
            "depth": snap.ingress.total,
            "lag": snap.ingress.lag,
            "pending": snap.ingress.pending,
            "prompt_tokens": snap.queue_prompt_tokens,
            "predicted_output_tokens": snap.queue_output_tokens,
        },
        "rates": {
            "generation_tokens_per_s": snap.generation_tokens_per_s,
            "throughput_tokens_per_s": snap.throughput_tokens_per_s,
            "drain_requests_per_s": snap.drain_rate,
            "arrival_requests_per_s": snap.arrival_rate,
        },
        "backlog_gpu_seconds": snap.backlog_gpu_seconds,
        "dead_letters": snap.dead_letters,
        "live_workers": len(snap.loads),
        "workers": snap.worker_summary(),
        "router_decisions": dict(sorted(snap.decisions.items())),
        "priorities": priorities(snap),
        "totals": totals(metrics),
        "history": list(metrics.history),
        "recent": recent_rows(snap),
    }


def priorities(snap: ClusterSnapshot) -> dict:
    """router.order.ordering's counters: requests queued per class, and per (class, tenant) the requests
    queued and the tokens dispatched (``lightq:queue_class_depth``, ``queue_tenant_depth``,
    ``tenant_dispatched_tokens``); classes as strings, the JSON keys they become anyway."""
    classes: dict[str, int] = {}
    for (priority, _), n in snap.tenant_queued.items():
        classes[str(priority)] = classes.get(str(priority), 0) + n
    tenants = [
        {
            "priority": priority,
            "tenant": tenant,
            "queued": snap.tenant_queued.get((priority, tenant), 0),
            "dispatched_tokens": snap.tenant_served.get((priority, tenant), 0),
        }
        for priority, tenant in sorted(set(snap.tenant_queued) | set(snap.tenant_served))
    ]
    return {"classes": dict(sorted(classes.items(), key=lambda item: int(item[0]))), "tenants": tenants}


def totals(metrics: ProducerMetrics) -> dict:
    ended = {labels["status"]: value for labels, value in _samples(metrics, "lightq:requests_ended_total")}
    return {
        "generation_tokens": _value(metrics, "lightq:generation_tokens_total"),
        "prompt_tokens": _value(metrics, "lightq:prompt_tokens_total"),
        "requests_ended": ended,
    }


def recent_rows(snap: ClusterSnapshot) -> list[dict]:
    """Each request's TTFT (first token published) and end-to-end time from its status hash."""
    rows = []
    for request in snap.recent[:RECENT_ROWS]:
        rows.append(
            {
                "id": request.id,
                "status": request.status,
                "prompt_tokens": request.prompt_tokens,
                "output_tokens": request.output_tokens,
                "max_new_tokens": request.max_new_tokens,
                "worker": request.worker,
                "age_s": max(0, snap.ts_ms - request.enqueued_ms) / 1000,
                "ttft_s": _since_created(request, request.started_ms),
                "e2e_s": _since_created(request, request.finished_ms),
            }
        )
    return rows


def _since_created(request: RecentRequest, ms: int | None) -> float | None:
    return None if ms is None else max(0, ms - request.created_ms) / 1000


def _samples(metrics: ProducerMetrics, name: str) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for family in metrics.exposition.collect() for s in family.samples if s.name == name]


def _value(metrics: ProducerMetrics, name: str) -> float:
    return sum(value for _, value in _samples(metrics, name))

"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright)
against a running ``lightq serve``: the numbers on the page equal what /metrics says.

Needs ``apt-get install -y chromium`` (skipped, saying so, where /usr/bin/chromium
is absent). Playwright's own browser download is never used: it drives the
system chromium through ``executable_path``.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from shared.embedded_redis import free_port
from tests.integration.stack import start_stack
from tests.monitoring.conftest import parse
from tests.waiting import MUST_HAPPEN_S

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent: apt-get install -y chromium"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):
    metrics_port = free_port()
    log = str(tmp_path_factory.mktemp("dashboard") / "serve.log")
    stack = start_stack(
        log,
        redis_url=redis_url,
        prefix=f"lightq-dash-{os.getpid()}",
        workers=2,
        extra=["--model_dir", "counting", "--max_total_token_num", "4096", "--metrics_port", str(metrics_port)],
    )
    stack.metrics_port = metrics_port
    yield stack
    stack.close()


def scrape(url: str) -> dict:
    return parse(httpx.get(f"{url}/metrics", timeout=10).text)


def decided(samples: dict) -> float:
    return sum(v for (name, _), v in samples.items() if name == "lightq:router_decisions_total")


def wait_idle(stack, num_requests: int) -> dict:
    """Until every request finished and the routers' decisions of all of them reached Redis."""
    deadline = time.monotonic() + MUST_HAPPEN_S
    while time.monotonic() < deadline:
        samples = scrape(stack.http)
        ended = samples.get(("lightq:requests_ended_total", (("status", "finished"),)), 0)
        idle = ended == num_requests and samples[("lightq:ingress_queue_depth", ())] == 0
        if idle and decided(samples) >= num_requests:
            return samples
        time.sleep(0.3)
    raise AssertionError("requests did not finish")


PAGE_COUNTS = (
    "[document.querySelectorAll('#recent tr').length, document.querySelectorAll('#workers tr').length, "
    "[...document.querySelectorAll('#decisions .decisions-n')].reduce((a, c) => a + +c.textContent, 0), "
    "document.getElementById('error').textContent]"
)


def wait_for_page(page, stack, num_requests: int) -> None:
    """Until the page lists every request, both workers and every decision. A loaded CI
    machine polls slowly, so the wait is long, and a timeout says what the page showed
    against what the producer serves (a CI run once timed out at 20 s with no clue why)."""
    from playwright.sync_api import TimeoutError as PageTimeout

    condition = f"(c => c[0] >= {num_requests} && c[1] == 2 && c[2] >= {num_requests})({PAGE_COUNTS})"
    try:
        page.wait_for_function(condition, timeout=60_000)
    except PageTimeout as err:
        data = httpx.get(f"{stack.http}/dashboard/data", timeout=10).json()
        served = [len(data["recent"]), len(data["workers"]), sum(data["router_decisions"].values())]
        raise AssertionError(
            f"page shows [recent, workers, decisions, error] = {page.evaluate(PAGE_COUNTS)}; "
            f"/dashboard/data has {served}; expected >= {num_requests}, 2, >= {num_requests}"
        ) from err


def test_router_and_workers_serve_their_own_metrics(stack):
    bodies = []
    for port in range(stack.metrics_port, stack.metrics_port + 16):
        try:
            bodies.append(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text)
        except httpx.HTTPError:
            continue
    assert sum("lightq:router_dispatches_total" in b for b in bodies) == 1
    assert sum("lightq:worker_kv_usage_ratio{" in b and "lightq:worker_step_seconds" in b for b in bodies) == 2


def test_page_shows_what_metrics_says(stack, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    lengths = [3, 5, 8, 4, 6, 7]
    for n in lengths:
        body = {"inputs": [11, 12, 13], "parameters": {"max_new_tokens": n, "ignore_eos": True}}
        assert httpx.post(f"{stack.http}/generate", json=body, timeout=60).status_code == 200
    shared = list(range(100, 230))  # 130 tokens: a hashed prefix, so the second meets the first's cache
    for n, tail in ((4, [7]), (5, [8])):
        body = {"inputs": shared + tail, "parameters": {"max_new_tokens": n, "ignore_eos": True}}
        assert httpx.post(f"{stack.http}/generate", json=body, timeout=60).status_code == 200
    lengths += [4, 5]
    client = stack.client()
    client.xadd(stack.keys.dead_letters(), {"msg": "{}", "reason": "test"})
    client.close()
    wait_idle(stack, len(lengths))

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{stack.http}/dashboard")
            wait_for_page(page, stack, len(lengths))
            shown = {
                name: page.inner_text(f"#{name}")
                for name in (
                    "queue-depth",
                    "queue-tokens",
                    "dead-letters",
                    "live-workers",
                    "generation-tokens",
                    "generation-rate",
                    "drain-rate",
                    "backlog",
                )
            }
            workers = page.eval_on_selector_all(
                "#workers tr",
                "rows => rows.map(r => [r.dataset.worker, "
                "r.querySelector('.pct').textContent, r.querySelector('.tokens').textContent, "
                "r.querySelector('.cached-n').textContent, r.querySelector('.hit-rate').textContent, "
                "r.querySelector('.evicted-n').textContent, r.querySelector('.preempted-n').textContent])",
            )
            tenants = page.eval_on_selector_all(
                "#tenants tr",
                "rows => rows.map(r => [r.dataset.priority, r.dataset.tenant, "
                "r.querySelector('.queued-n').textContent, r.querySelector('.dispatched-n').textContent])",
            )
            decisions = page.eval_on_selector_all(
                "#decisions tr",
                "rows => rows.map(r => [r.dataset.reason, r.querySelector('.decisions-n').textContent])",
            )
            statuses = page.eval_on_selector_all("#recent tr", "rows => rows.map(r => r.cells[1].textContent)")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    samples = scrape(stack.http)

    assert shown["queue-depth"] == f"{samples[('lightq:ingress_queue_depth', ())]:.0f}" == "0"
    assert shown["dead-letters"] == f"{samples[('lightq:dead_letters', ())]:.0f}" == "1"
    assert shown["live-workers"] == f"{samples[('lightq:live_workers', ())]:.0f}" == "2"
    assert shown["generation-tokens"] == f"{samples[('lightq:generation_tokens_total', ())]:.0f}" == str(sum(lengths))
    assert shown["generation-rate"] == f"{samples[('lightq:generation_tokens_per_second', ())]:.2f}"
    assert shown["drain-rate"] == f"{samples[('lightq:queue_drain_requests_per_second', ())]:.2f}"
    assert shown["backlog"] == f"{samples[('lightq:backlog_gpu_seconds', ())]:.2f}"
    queued = sum(samples[("lightq:queue_tokens", (("kind", kind),))] for kind in ("prompt", "predicted_output"))
    assert shown["queue-tokens"] == f"{queued:.0f}"
    for worker, pct, tokens, cached, hit_rate, evicted, preempted in workers:
        label = (("worker", worker),)
        assert pct == f"{100 * samples[('lightq:worker_kv_usage_ratio', label)]:.1f}%"
        assert tokens == (
            f"{samples[('lightq:worker_used_tokens', label)]:.0f} / "
            f"{samples[('lightq:worker_max_total_tokens', label)]:.0f}"
        )
        assert cached == f"{samples[('lightq:worker_prefix_cached_tokens', label)]:.0f}"
        assert hit_rate == f"{100 * samples[('lightq:worker_prefix_hit_ratio', label)]:.1f}%"
        assert evicted == f"{samples[('lightq:worker_prefix_evicted_tokens_total', label)]:.0f}"
        assert preempted == (
            f"{samples[('lightq:worker_priority_preemptions_total', label)]:.0f} "
            f"({samples[('lightq:worker_preempted_kv_tokens_total', label)]:.0f})"
        )
    assert any(hit_rate != "0.0%" for *_, hit_rate, _, _ in workers), "the shared prompt was found cached"
    dispatched = {
        (labels[0][1], labels[1][1]): value
        for (name, labels), value in samples.items()
        if name == "lightq:tenant_dispatched_tokens_total"
    }
    assert tenants and {(p, t): float(n) for p, t, _, n in tenants} == dispatched
    assert sum(dispatched.values()) > 0, "the requests' tokens were counted for their tenant"
    assert {reason: int(n) for reason, n in decisions} == {
        labels[0][1]: value for (name, labels), value in samples.items() if name == "lightq:router_decisions_total"
    }
    assert dict(decisions).get("prefix_hit") == "1", "the second shared prompt went to the first's worker"
    assert statuses.count("finished") == samples[("lightq:requests_ended_total", (("status", "finished"),))]

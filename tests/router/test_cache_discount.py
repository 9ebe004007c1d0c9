"""The router's check counts only what a request adds where running requests hold a prefix of it
(``WorkerLoad.held_prefixes``), as the worker's own check does (``Admission.adds``), and never less:
records come from a real engine (counting model, real radix tree, ``build_load``), and what the
router admits the worker's engine admits too. An evictable prefix is counted in full."""

from __future__ import annotations

import random

import pytest
import torch

from router.admission.views import Views
from router.admission.worker_view import WorkerView, cacheable_prompt
from shared.admission import AdmissionRule, request_states
from shared.batch_view import BatchView, Candidate
from shared.codec import encode, entry
from shared.config import AdmissionSettings
from shared.prefix_hash import PREFIX_BLOCK, prefix_hashes
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, SamplingParams
from tests.router.helpers import inbox_ids
from tests.router.test_loop import make_router
from worker.engine.engine import Engine, EngineLimits
from worker.engine.load import build_load
from worker.engine.load import request_states as worker_states
from worker.engine.radix_cache import RadixCache
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.model.counting_model import CountingModel
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable

VOCAB = 256
SETTINGS = {"history_window": 10, "history_prior": 40}
SYSTEM = [3 + (i * 37) % 250 for i in range(200)]  # a 200-token prompt prefix the requests below share


def engine(pool: int, admission: str = "conservative") -> Engine:
    cpu = torch.device("cpu")
    slots = TokenPool(pool)
    table = ReqTable(16, 1024, pool, cpu)
    runner = ModelRunner(CountingModel(VOCAB, cpu), slots, table, VOCAB, cpu, prefix_cache=RadixCache(slots))
    rule = AdmissionRule(AdmissionSettings(admission=admission, **SETTINGS))
    return Engine(runner, EngineLimits(pool, 4096, 16), eos_ids=set(), rule=rule)


def message(rid: str, prompt: list[int], max_new: int, n: int = 1, logprobs: bool = False) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, prompt_logprobs=0 if logprobs else None)
    return GenerateRequest(id=rid, prompt_ids=prompt, params=params, n=n, created_ms=now_ms())


def run(eng: Engine, *msgs: GenerateRequest, steps: int = 1) -> list[Req]:
    reqs = [Req(msg=m, inbox_id=f"{m.id}-0") for m in msgs]
    for r in reqs:
        eng.add(r)
    for _ in range(steps):
        eng.step()
    return reqs


def record(eng: Engine, worker_id: str = "w"):
    eng.runner.slots.refresh_summary(idle=True)  # the serve loop's, after its step
    return build_load(eng, worker_id, 1, "0-0")


def router_use(load, msg: GenerateRequest, policy) -> tuple[float | None, int]:
    """What the router's view of the record answers for ``msg``, and the discount it took."""
    view = WorkerView(load, [], policy)
    hashes = prefix_hashes(cacheable_prompt(msg))
    held = view.hit(hashes, view.held) if hashes else 0
    return view.ratio(Candidate(request_states(msg), policy), held), held


def worker_use(eng: Engine, msg: GenerateRequest) -> tuple[float | None, int]:
    """The worker's own check of ``msg`` against its running requests (``Admission.admit``'s)."""
    req = Req(msg=msg, inbox_id="c-0")
    view = BatchView(worker_states(eng.running), eng.limits.max_total_tokens, 16, eng.rule.policy)
    return view.ratio(Candidate(eng.admission.adds(req), eng.rule.policy)), eng.runner.slots.held_prefix(req)


@pytest.mark.parametrize("admission", ["conservative", "past_future"])
@pytest.mark.parametrize("seed", range(4))
def test_the_router_counts_a_held_prefix_like_the_worker_and_never_less(admission, seed):
    rng = random.Random(seed)
    eng = engine(4000, admission)
    bases = [SYSTEM[: rng.randrange(64, 200)], [3 + (i * 11) % 250 for i in range(rng.randrange(64, 180))]]

    def prompt(tag: int) -> list[int]:
        base = rng.choice(bases)
        return base[: rng.randrange(30, len(base) + 1)] + [3 + (tag * 7 + j) % 250 for j in range(rng.randrange(1, 40))]

    run(eng, *(message(f"done{i}", prompt(i), 2) for i in range(3)), steps=6)  # ended: evictable
    run(eng, *(message(f"run{i}", prompt(10 + i), 300, n=rng.choice([1, 1, 2])) for i in range(4)), steps=3)
    assert all(r.is_prefilled for r in eng.running) and not eng.waiting
    load = record(eng)
    assert load.held_prefixes, "running requests hold cached prefixes"
    policy = AdmissionRule(AdmissionSettings(admission=admission, **SETTINGS)).policy  # the router's own
    discounts = 0
    for i in range(40):
        msg = message(f"c{i}", prompt(20 + i), rng.randrange(1, 400), n=rng.choice([1, 1, 2]), logprobs=i % 9 == 0)
        (router, router_held), (worker, worker_held) = router_use(load, msg, policy), worker_use(eng, msg)
        undiscounted = WorkerView(load, [], policy).ratio(Candidate(request_states(msg), policy))
        assert 0 <= worker_held - router_held < PREFIX_BLOCK, "the discount is the worker's, to a hash block"
        assert worker is not None and router is not None, "the pool is big enough for every candidate"
        assert worker <= router <= (undiscounted or 0), "never more optimistic than the worker"
        assert (router - worker) * eng.limits.max_total_tokens < PREFIX_BLOCK
        discounts += router_held > 0
    assert discounts >= 3, discounts


def test_an_evictable_prefix_is_counted_in_full():
    eng = engine(1000)
    run(eng, message("first", SYSTEM + [5], 2), steps=4)  # ended: its tokens are cached, evictable
    run(eng, message("other", [7] * 100, 400), steps=1)
    load = record(eng)
    msg = message("next", SYSTEM + [9], 300)
    assert WorkerView(load, [], eng.rule.policy).hit(prefix_hashes(cacheable_prompt(msg))) == 192  # cached
    assert router_use(load, msg, eng.rule.policy) == (None, 0)  # but not held: 500 + 501 > 1000
    assert worker_use(eng, msg) == (None, 0)


def publish(client, keys, load) -> None:
    client.set(keys.load(load.worker_id), encode(load), px=5000)
    client.zadd(keys.workers(), {load.worker_id: now_ms()})


def test_the_router_sends_what_fits_only_with_the_discount_and_the_worker_takes_it(redis_settings, rclient, keys):
    """The holder runs a request holding SYSTEM (205 + 300 of 1,000 conservatively); the next
    (210 + 300) fits beside it only if the 200 shared tokens count once. The other worker is
    full; one whose copy of SYSTEM is only evictable is not asked to take it either."""
    holder, evicted, full = engine(1000), engine(1000), engine(1000)
    run(holder, message("running", SYSTEM + [1, 2, 3, 4, 5], 300), steps=2)
    run(evicted, message("ended", SYSTEM + [1, 2, 3, 4, 5], 2), steps=4)
    run(evicted, message("big", [9] * 300, 300), steps=1)
    run(full, message("huge", [8] * 600, 300), steps=1)
    for eng, worker_id in ((holder, "holder"), (evicted, "evicted"), (full, "full")):
        publish(rclient, keys, record(eng, worker_id))
    router = make_router(redis_settings, rclient, admission_rule=AdmissionSettings(admission="conservative"))
    msg = message("next", SYSTEM + [6] * 10, 300)
    rclient.xadd(keys.requests(), entry(msg))
    router.step()
    assert inbox_ids(rclient, keys, "holder") == ["next"]
    assert inbox_ids(rclient, keys, "evicted") == inbox_ids(rclient, keys, "full") == []
    [taken] = run(holder, msg)
    assert taken in holder.running, "the worker's own check admits it"
    [refused] = run(evicted, message("again", SYSTEM + [6] * 10, 300))
    assert refused in evicted.waiting, "where the prefix was only evictable, the worker refuses it too"


def test_views_admit_what_they_counted_at_the_chosen_worker():
    """``Views``: the chosen worker's view counts what ``choose`` weighed there (the discount),
    so the next decision sees the same use the worker will."""
    eng = engine(1000)
    run(eng, message("running", SYSTEM + [1, 2, 3, 4, 5], 300), steps=2)
    load = record(eng)
    policy = eng.rule.policy
    views = Views(policy)
    views.refresh({"w": load}, {})
    # each next one needs 210 + 150 = 360, less the 192 held: 505 + 168 = 673, then 841 (had the
    # first been counted in full, 865 + 168 > 1,000), then 1,009: no room for a third
    for rid, fits in (("a", True), ("b", True), ("c", False)):
        msg = message(rid, SYSTEM + [6] * 10, 150)
        candidate = Candidate(request_states(msg), policy)
        chosen = views.choose(candidate, None, cacheable_prompt(msg))
        assert chosen == ("w" if fits else None)
        if chosen is not None:
            views.admit(chosen, candidate)


def test_a_request_that_would_not_fit_alone_in_full_is_never_discounted():
    """The holder ends in one step; at the peak only the candidate is left (exact lengths), so the
    discount would let it in: 400 - 192 + 700 = 908 <= 950. Were the record stale (the holder gone),
    the worker would count 400 + 700 = 1,100 on an empty pool, and the request would wait there for
    ever; so it is not discounted, and the router keeps it."""
    eng = engine(1000, "past_future_quantile")
    run(eng, message("holder", SYSTEM + [1] * 100, 2), steps=1)  # 300 held (SYSTEM's 192 hashed), 1 to go
    load = record(eng)
    policy = eng.rule.policy
    too_long = message("long", SYSTEM + [6] * 200, 700)
    view = WorkerView(load, [], policy)
    candidate = Candidate(request_states(too_long), policy)
    assert view.hit(prefix_hashes(cacheable_prompt(too_long)), view.held) == 192
    assert BatchView(worker_states(eng.running), 1000, 16, policy).ratio(candidate.less(192)) is not None
    assert router_use(load, too_long, policy) == (None, 192)
    fits = message("fits", SYSTEM + [6] * 200, 500)  # 900 alone: discounted as usual
    assert router_use(load, fits, policy)[0] == pytest.approx((400 - 192 + 500) / 1000)

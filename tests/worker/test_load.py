"""The load record a worker publishes, down to what the router reads back."""

from router.workers.registry import read_registry
from shared.codec import decode, encode
from shared.history import Estimator, OutputLengthHistory
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_load import WorkerLoad
from shared.worker_settings import WorkerSettings
from tests.router.test_admission import choose
from worker.engine.engine import EngineLimits, LoadSnapshot
from worker.engine.load import build_load, request_states
from worker.engine.request import Phase, Req
from worker.service.heartbeat import Heartbeat
from worker.service.serve import WorkerService


def req(rid, prompt, max_new, output=(), resume=(), ignore_eos=False, phase=Phase.RUNNING):
    msg = GenerateRequest(
        id=rid,
        prompt_ids=[1] * prompt,
        created_ms=0,
        resume_ids=list(resume),
        params=SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos),
    )
    r = Req(msg=msg, inbox_id=f"{rid}-0", phase=phase)
    r.output_ids += list(output)
    return r


class FakeEngine:
    """What build_load reads from worker.engine.engine.Engine."""

    def __init__(self, running, waiting, pool=1000, running_max=8):
        self.limits = EngineLimits(max_total_tokens=pool, batch_max_tokens=256, running_max_req_size=running_max)
        self.running, self.waiting = running, waiting
        self.num_preempted, self.num_preempted_tokens = 2, 90  # pauses for a better class, and their K/V

    def requests(self):
        return [*self.running, *self.waiting]

    def snapshot(self):
        reqs = self.requests()
        return LoadSnapshot(
            used_tokens=sum(r.num_tokens for r in self.running),
            committed_tokens=sum(r.msg.max_tokens_needed for r in reqs),
            num_running=len(self.running),
            num_waiting=len(self.waiting),
        )


def engine():
    running = [req("a", 10, 50, output=[3] * 7), req("b", 20, 30, output=[3] * 2, ignore_eos=True)]
    waiting = [req("c", 5, 100, resume=[9, 9, 9], phase=Phase.WAITING)]
    return FakeEngine(running, waiting)


def test_each_request_is_summarised_as_held_generated_max_new_ignore_eos():
    load = build_load(engine(), "w1", seq=4, last_inbox_id="7-0")
    assert load.requests == [(17, 7, 50, 0), (22, 2, 30, 1), (8, 3, 100, 0)]
    assert load.running_max_req_size == 8 and load.max_total_tokens == 1000
    assert load.committed_tokens == 60 + 50 + 105  # the conservative need still adds up
    assert (load.seq, load.last_inbox_id, load.num_running, load.num_waiting) == (4, "7-0", 2, 1)
    assert (load.preempted_requests, load.preempted_kv_tokens) == (2, 90)  # for the dashboard
    assert decode(WorkerLoad, encode(load)) == load
    assert '"requests":[[17,7,50,0],' in encode(load)  # compact: four integers a request


def test_a_request_seen_in_both_lists_is_listed_once_and_finished_ones_not_at_all():
    r = req("a", 10, 50)
    done = req("d", 10, 50, phase=Phase.FINISHED)
    assert request_states([r, done, r]) == [(10, 0, 50, 0)]


def test_service_heartbeat_reaches_the_router(redis_settings, rclient, keys):
    service = WorkerService(
        WorkerSettings(redis=redis_settings), rclient, engine(), worker_id="w1", publisher=None
    )  # the load record needs no publisher
    service.last_inbox_id = "9-0"
    Heartbeat(rclient, keys, "w1", 0.5, service.load).beat()
    registry = read_registry(rclient, keys, stale_ms=5000)
    load = registry.admissible()["w1"]
    assert load.requests == [(17, 7, 50, 0), (22, 2, 30, 1), (8, 3, 100, 0)] and load.last_inbox_id == "9-0"
    assert load.admission_limit == 950  # the pool less past-future's 5% margin: what the producer checks by
    big = GenerateRequest(
        id="x", prompt_ids=[1] * 500, created_ms=0, params=SamplingParams(max_new_tokens=500, ignore_eos=True)
    )
    est = Estimator(OutputLengthHistory(window=10, prior=50))
    assert choose(registry.live, {}, big, "past_future", est) is None  # 1,000 more: over 950
    small = big.model_copy(update={"params": SamplingParams(max_new_tokens=100, ignore_eos=True)})
    assert choose(registry.live, {}, small, "past_future", est) == "w1"

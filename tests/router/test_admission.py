from router.admission import can_admit, choose_worker
from router.reservations import Reservations
from shared.schemas import GenerateRequest, SamplingParams, WorkerLoad


def load(worker_id, max_total=100, committed=0, draining=False, last_inbox_id="0-0"):
    return WorkerLoad(worker_id=worker_id, seq=1, ts_ms=0, max_total_tokens=max_total, used_tokens=0,
                      committed_tokens=committed, num_running=0, num_waiting=0, draining=draining,
                      last_inbox_id=last_inbox_id)


def request(prompt=10, new=10):
    return GenerateRequest(id="r", prompt_ids=[1] * prompt, params=SamplingParams(max_new_tokens=new), created_ms=0)


def test_conservative_check_counts_prompt_plus_max_new_tokens():
    assert can_admit(load("a", max_total=20), 0, request(10, 10))
    assert not can_admit(load("a", max_total=20), 1, request(10, 10))
    assert not can_admit(load("a", max_total=100, committed=81), 0, request(10, 10))
    assert not can_admit(load("a", draining=True), 0, request())


def test_least_loaded_admissible_worker_wins():
    loads = {"a": load("a", committed=50), "b": load("b", committed=10), "c": load("c", committed=0)}
    assert choose_worker(loads, {"c": 95}, request()) == "b"
    assert choose_worker(loads, {"b": 80, "c": 95}, request()) == "a"
    assert choose_worker(loads, {"a": 50, "b": 90, "c": 95}, request()) is None


def test_reservations_settle_when_the_worker_reports_the_entry():
    res = Reservations(ttl_s=60)
    res.add("a", "5-0", 20)
    res.add("a", "7-0", 30)
    res.settle({"a": load("a", last_inbox_id="5-0")})
    assert res.tokens() == {"a": 30}
    res.settle({"a": load("a", last_inbox_id="7-0")})
    assert res.tokens() == {}


def test_reservations_of_a_vanished_worker_are_dropped():
    res = Reservations(ttl_s=60)
    res.add("a", "5-0", 20)
    res.settle({})
    assert res.tokens() == {}

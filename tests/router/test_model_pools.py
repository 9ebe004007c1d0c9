"""One pool per served model: the router sends a request only to workers of its model
(real Redis, workers played by the test)."""

from shared.schemas import GenerateRequest, SamplingParams
from tests.router.helpers import inbox_ids, publish_load, submit
from tests.router.test_admission import choose, load
from tests.router.test_loop import make_router


def test_requests_go_only_to_workers_of_their_model(redis_settings, rclient, keys):
    publish_load(rclient, keys, "big-a", max_total=1000, committed=500, model="a")  # busier, but "a"
    publish_load(rclient, keys, "idle-b", max_total=1000, model="b")
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "for-a", model="a")
    submit(rclient, keys, "for-b", model="b")
    submit(rclient, keys, "group-a", model="a", n=2)  # a group: the same check, all its samples
    submit(rclient, keys, "any", model=None)  # an older producer's: any worker
    router.step()
    assert inbox_ids(rclient, keys, "big-a") == ["for-a", "group-a"]
    assert inbox_ids(rclient, keys, "idle-b") == ["for-b", "any"]


def test_a_request_whose_model_no_worker_serves_waits(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w", model="a")
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "for-c", model="c")
    router.step()
    assert inbox_ids(rclient, keys, "w") == []
    publish_load(rclient, keys, "w-c", model="c")  # a worker of that model joins
    router.step()
    assert inbox_ids(rclient, keys, "w-c") == ["for-c"]


def test_choose_worker_filters_by_model():
    loads = {"a": load("a").model_copy(update={"model": "a"}), "b": load("b").model_copy(update={"model": "b"})}
    req = GenerateRequest(
        id="r", prompt_ids=[1] * 10, created_ms=0, model="b", params=SamplingParams(max_new_tokens=10)
    )
    assert choose(loads, {}, req, "conservative") == "b"
    assert choose(loads, {}, req.model_copy(update={"model": "z"}), "conservative") is None

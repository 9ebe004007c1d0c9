"""LoRA adapters in routing (issue 32): a request naming an adapter goes only to a worker whose load
record lists it (however loaded the others are), waits when none does, and is never matched
against prefix caches (its K/V is the adapter's). Among those serving it, a worker holding it on
the device is preferred, traded against load as prefix hits are, so a hot adapter spreads under
load; a burst for one adapter meets the worker it was just sent to."""

from __future__ import annotations

from router.admission.views import Views
from router.admission.worker_view import cacheable_prompt
from shared.admission import POLICIES, request_states
from shared.batch_view import Candidate
from tests.router.test_cache_aware import TURN1, TURN2, estimator, message, record, summary_after


def choose(loads, msg, reason=None, views=None):
    views = views or Views(POLICIES["conservative"](estimator(), 0.05))
    views.refresh({load.worker_id: load for load in loads}, {})
    chosen = views.choose(Candidate(request_states(msg), views.policy), None, cacheable_prompt(msg), msg.adapter)
    assert reason is None or views.last_reason == reason
    return chosen


def serving(worker_id, held=0, resident=()):
    """A record of a worker serving adapter ``sql`` (and ``poems``), holding ``resident`` on its device."""
    load = record(worker_id, held=held)
    return load.model_copy(update={"adapters": ["sql", "poems"], "resident_adapters": list(resident)})


def test_an_adapter_request_goes_only_where_the_adapter_is_loaded():
    busy = record("busy", held=1500).model_copy(update={"adapters": ["sql"]})
    idle = record("idle")
    sql = message("a", list(range(100, 140))).model_copy(update={"adapter": "sql"})
    assert choose([idle, busy], sql) == "busy"
    assert choose([idle, busy], message("b", list(range(100, 140)))) == "idle"  # the base: by load
    assert choose([idle, busy], sql.model_copy(update={"adapter": "poems"})) is None  # nobody serves it: waits


def test_an_adapter_request_is_not_matched_against_the_prefix_caches():
    holder = record("holder", held=300, prefixes=summary_after(TURN1)).model_copy(update={"adapters": ["sql"]})
    msg = message("t2", TURN2)
    assert len(cacheable_prompt(msg)) == len(TURN2) - 1
    assert cacheable_prompt(msg.model_copy(update={"adapter": "sql"})) == ()
    assert choose([holder], msg.model_copy(update={"adapter": "sql"})) == "holder"


def test_the_worker_holding_the_adapter_wins_until_load_outweighs_it():
    sql = message("a", list(range(100, 140))).model_copy(update={"adapter": "sql"})
    # a little busier, but the adapter is on its device: it wins over the idle worker
    assert choose([serving("idle"), serving("holder", held=300, resident=["sql"])], sql, "adapter_hit") == "holder"
    # far busier (a quarter of the pool and more above the idle one): the hot adapter spreads
    assert choose([serving("idle"), serving("holder", held=900, resident=["sql"])], sql, "load_over_adapter") == "idle"
    # nobody holds it: by load
    assert choose([serving("idle"), serving("busy", held=300)], sql, "least_loaded") == "idle"
    # the base model's requests are not drawn to a worker by its adapters
    base = message("b", list(range(100, 140)))
    assert choose([serving("idle"), serving("holder", held=300, resident=["sql"])], base) == "idle"


def test_a_burst_for_one_adapter_meets_the_worker_it_was_just_sent_to():
    views = Views(POLICIES["conservative"](estimator(), 0.05))
    sql = message("a", list(range(100, 140))).model_copy(update={"adapter": "sql"})
    first = choose([serving("w1"), serving("w2")], sql, "least_loaded", views)
    assert first == "w1"
    # w2 a little less loaded now, and neither record shows sql yet: the one it was sent to wins
    again = choose([serving("w1", held=100), serving("w2", held=50)], sql.model_copy(update={"id": "b"}), views=views)
    assert again == "w1" and views.last_reason == "adapter_hit"


def test_a_miss_goes_where_the_least_popular_adapter_would_be_evicted():
    views = Views(POLICIES["conservative"](estimator(), 0.05))
    for adapter in ["hot"] * 5 + ["warm"] * 2 + ["cold"]:
        views.popularity.count(adapter)
    assert views.popularity.value("hot") > views.popularity.value("warm") > views.popularity.value("cold") > 0
    sql = message("a", list(range(100, 140))).model_copy(update={"adapter": "sql"})
    keeps_hot = serving("w1", resident=["hot", "warm"])
    loses_cold = serving("w2", held=50, resident=["hot", "cold"])  # a little busier: the spare slot wins
    assert choose([keeps_hot, loses_cold], sql, "adapter_spare", views) == "w2"
    # far busier (over 5% of the pool above): load decides
    busy = serving("w2", held=400, resident=["hot", "cold"]).model_copy(update={"seq": 2})  # a newer record
    assert choose([keeps_hot, busy], sql.model_copy(update={"adapter": "poems"}), "load_over_adapter", views) == "w1"


def test_popularity_decays_and_stays_bounded():
    from router.lora.adapter_popularity import Popularity

    popularity = Popularity()
    popularity.count("old")
    for _ in range(30_000):  # past a rescaling: the old count fades, the recent one leads
        popularity.count("new")
    assert popularity.value("new") > 100 * popularity.value("old") >= 0
    assert popularity.cheapest(["new", "old"]) == popularity.value("old") and popularity.cheapest([]) == -1.0

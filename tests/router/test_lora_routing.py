"""LoRA adapters in routing (issue 32, this slice): a request naming an adapter goes only to a
worker whose load record lists it (however loaded the others are), waits when none does, and is
never matched against prefix caches (its K/V is the adapter's)."""

from __future__ import annotations

from router.admission import Views, cacheable_prompt
from shared.admission import POLICIES, request_states
from shared.batch_view import Candidate
from tests.router.test_cache_aware import TURN1, TURN2, estimator, message, record, summary_after


def choose(loads, msg):
    views = Views(POLICIES["conservative"](estimator(), 0.05))
    views.refresh({load.worker_id: load for load in loads}, {})
    return views.choose(Candidate(request_states(msg), views.policy), None, cacheable_prompt(msg), msg.adapter)


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

"""The runner keeps a batch's parameter tensors across decode steps only while the batch is unchanged."""

import torch

from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.schemas import GenerateRequest, SamplingParams
from tests.worker.token_rows import flat
from worker.engine.engine import Engine, EngineLimits
from worker.engine.events import Token
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.model.counting_model import CountingModel
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable


def counting_engine(room: int = 4, slots: int = 256) -> Engine:
    cpu = torch.device("cpu")
    runner = ModelRunner(CountingModel(256, cpu), TokenPool(slots), ReqTable(room, 32, slots, cpu), 256, cpu)
    return Engine(runner, EngineLimits(slots, 64, room), set(), AdmissionRule(AdmissionSettings()))


def add(engine, rid, **params):
    msg = GenerateRequest(
        id=rid, prompt_ids=[5, 6, 7], created_ms=0, params=SamplingParams(max_new_tokens=6, ignore_eos=True, **params)
    )
    engine.add(Req(msg=msg, inbox_id=f"{rid}-0"))


def tokens(events, rid):
    return [e for e in events if isinstance(e, Token) and e.request_id == rid]


def test_a_joining_request_gets_its_own_parameters_and_leaving_ones_take_theirs_along():
    engine = counting_engine()
    add(engine, "a")
    first = engine.runner._row_params
    flat(engine.step()), engine.step()
    assert engine.runner._row_params is not first
    kept = engine.runner._row_params[1]
    engine.step()
    assert engine.runner._row_params[1] is kept  # same batch: the same tensors
    add(engine, "b", top_logprobs=2)  # joins: its alternatives must come with its tokens
    events = flat(engine.step()) + engine.step()
    assert engine.runner._row_params[0] == (("a", 0), ("b", 0))
    assert all(t.top is None for t in tokens(events, "a"))
    assert tokens(events, "b") and all(len(t.top) == 2 for t in tokens(events, "b"))
    while engine.running:  # a leaves first: b's parameters are rebuilt for the batch of one
        events = flat(engine.step())
    assert all(len(t.top) == 2 for t in tokens(events, "b"))
    assert engine.runner._row_params[0] == (("b", 0),)
    assert torch.equal(engine.runner._row_params[1].top_k, torch.tensor([256]))

"""The prefix cache on the CUDA path (runs only where a GPU is present): Triton prefill over a
cached prefix read through the request table, one-request prefill graphs starting after a
cached prefix, decode graphs; greedy tokens with the cache on equal those with it off."""

import pytest
import torch

from shared.config import ModelSettings
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.worker.token_rows import flat
from worker.engine.events import Token
from worker.engine.request import Req
from worker.main import build_engine

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

# The GPU backend tests' tiny Llama (peaked logits: no near-ties for batch shapes to break differently)
from tests.worker.test_gpu_backend import tiny_dir  # noqa: E402, F401 (fixture)

SYSTEM = list(range(100, 400))  # 300 shared tokens


def message(rid: str, prompt: list[int], n: int = 1) -> Req:
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    return Req(msg=GenerateRequest(id=rid, prompt_ids=prompt, created_ms=0, params=params, n=n), inbox_id=f"{rid}-0")


def waves(model_dir: str, cache: bool) -> tuple[dict[tuple[str, int], list[int]], int]:
    settings = WorkerSettings(
        model=ModelSettings(model_dir=model_dir, max_req_total_len=1024),
        device="cuda",
        dtype="float32",
        max_total_token_num=2048,  # small: the later waves evict
        running_max_req_size=16,
        graph_max_batch_size=16,
        prefix_cache=cache,
    )
    engine = build_engine(settings)
    batches = [
        [message("a", SYSTEM + [1, 2, 3])],  # alone: a prefill graph, then cached
        [message("b", SYSTEM + [1, 2, 4]), message("c", SYSTEM[:150] + [9] * 40)],  # hits beside each other
        [message("g", SYSTEM + [1, 2, 3, 7], n=3), message("d", list(range(500, 900)))],  # a group on a hit
        [message(f"e{i}", [600 + i] * 200 + SYSTEM[:64]) for i in range(6)],  # misses: evictions
        [message("f", SYSTEM + [1, 2, 4, 5])],
    ]
    out: dict[tuple[str, int], list[int]] = {}
    for batch in batches:
        for req in batch:
            engine.add(req)
        while engine.has_work:
            for e in flat(engine.step()):
                if isinstance(e, Token):
                    out.setdefault((e.request_id, e.choice), []).append(e.token_id)
    slots = engine.runner.slots
    assert slots.num_held == 0 and slots.available == 2048
    return out, slots.num_hit


def test_greedy_tokens_equal_with_the_cache_on_and_off(tiny_dir):
    off, no_hits = waves(tiny_dir, False)
    on, hits = waves(tiny_dir, True)
    assert no_hits == 0 and hits >= 302 + 150 + 303  # b, c, g (f may find its prefix evicted)
    assert on == off

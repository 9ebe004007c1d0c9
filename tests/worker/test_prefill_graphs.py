"""A small prefill padded to its bucket (``worker.runner.prefill_graphs``) gives the eager forward's logits.

On the CPU the padded step runs eagerly through the PyTorch reference (the padding logic); on a GPU
the captured graph is replayed against the eager Triton forward, and an engine whose prefills
arrive one at a time (each one a graph) decodes the CPU's greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from shared.model_files import ModelSource
from tests.worker.model_harness import build_batch
from worker.engine.token_pool import TokenPool
from worker.model.loader import attach_kv_cache, load_model
from worker.runner.prefill_graphs import PrefillGraphs
from worker.runner.req_table import ReqTable


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-prefill-graphs")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=256,
        eos_token_id=0,
        initializer_range=0.15,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def setup(folder: str, device: str):
    model, config = load_model(ModelSource("hf", folder), torch.float32, device)
    cache = attach_kv_cache(model, 512, device)
    cache.buffer.normal_()  # K/V nobody wrote: reading any would change the logits
    table, pool = ReqTable(4, 128, cache.hold_slot, device), TokenPool(512)
    pool.allocate(5)
    return model, config, cache, table, pool


def compare(folder: str, device: str, capture: bool) -> None:
    model, config, cache, table, pool = setup(folder, device)
    graphs = PrefillGraphs(
        model, table, cache.hold_slot, config.vocab_size, torch.device(device), buckets=(8, 32), capture=capture
    )
    rng = np.random.default_rng(0)
    for cached_len, new_len in [(0, 5), (0, 8), (6, 13), (20, 32), (3, 1)]:
        row = table.allocate_row()
        prompt = rng.integers(1, config.vocab_size, size=cached_len + new_len).tolist()
        slots = pool.allocate(cached_len + new_len)
        table.write(row, 0, slots)
        if cached_len:  # the cached prefix, prefilled eagerly first
            cached = build_batch(table.table, [row], [0], [prompt[:cached_len]], [slots[:cached_len]])
            model.forward(_on(cached, device))
        eager = (
            model.forward(
                _on(build_batch(table.table, [row], [cached_len], [prompt[cached_len:]], [slots[cached_len:]]), device)
            )
            .float()
            .cpu()
        )
        graphs.logits.fill_(float("nan"))  # poisoned: the run must write it
        before = cache.buffer.clone()
        positions = np.arange(cached_len, cached_len + new_len)
        if capture:
            padded = graphs.run(np.array(prompt[cached_len:]), positions, slots[cached_len:], row, cached_len)
        else:
            graphs.step(graphs.load(np.array(prompt[cached_len:]), positions, slots[cached_len:], row, cached_len))
            padded = graphs.logits
        assert torch.isfinite(padded).all()
        untouched = torch.ones(cache.buffer.shape[1], dtype=torch.bool)
        untouched[torch.as_tensor(slots[cached_len:], dtype=torch.long)] = False
        untouched[cache.hold_slot] = False  # where the padding's K/V go
        assert torch.equal(cache.buffer[:, untouched], before[:, untouched])  # no one else's K/V
        assert torch.allclose(padded.float().cpu(), eager, atol=1e-3, rtol=1e-3), (cached_len, new_len)
        table.free_row(row)


def _on(batch, device: str):
    import dataclasses

    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return type(batch)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()})


def test_a_padded_prefill_gives_the_eager_logits_on_the_cpu(tiny_dir):
    compare(tiny_dir, "cpu", capture=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_replayed_prefill_graph_gives_the_eager_logits(tiny_dir):
    compare(tiny_dir, "cuda", capture=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefills_arriving_one_at_a_time_decode_the_cpu_tokens(tiny_dir):
    from shared.config import ModelSettings
    from shared.schemas import GenerateRequest, SamplingParams
    from shared.worker_settings import WorkerSettings
    from tests.worker.token_rows import flat
    from worker.engine.events import Token
    from worker.engine.request import Req
    from worker.main import build_engine

    def greedy(device: str) -> dict[str, list[int]]:
        settings = WorkerSettings(
            model=ModelSettings(model_dir=tiny_dir, max_req_total_len=128),
            device=device,
            dtype="float32",
            max_total_token_num=2048,
            running_max_req_size=8,
            cuda_graphs=device == "cuda",
            graph_max_batch_size=8,
        )
        engine = build_engine(settings)
        if device == "cuda":
            assert engine.runner.prefill_graphs is not None
        out: dict[str, list[int]] = {}
        prompts = [list(range(3, 3 + n)) for n in (5, 40, 1, 17)]
        for step in range(60):
            if step < len(prompts):  # one newcomer a step: each prefill alone, beside the decodes
                msg = GenerateRequest(
                    id=str(step),
                    prompt_ids=prompts[step],
                    created_ms=0,
                    params=SamplingParams(max_new_tokens=12, ignore_eos=True),
                )
                engine.add(Req(msg=msg, inbox_id=f"{step}-0"))
            for e in flat(engine.step()):
                if isinstance(e, Token):
                    out.setdefault(e.request_id, []).append(e.token_id)
        return out

    assert greedy("cuda") == greedy("cpu")

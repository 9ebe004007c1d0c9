"""LoRA on the GPU (issue 32): the Triton kernels (SGMV prefill, BGMV decode, inside the decode
CUDA graphs) against the CPU's PyTorch path, through the worker's own ``build_engine`` with
``--lora_modules``: greedy tokens equal in fp32 (graphs on and off), and in bf16 a mixed batch's
logits stay within bf16's error of the CPU's fp32 ones while each adapter moves them far more."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.config import ModelSettings
from shared.model_files import ModelSource
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.worker.lora_helpers import AdapterRecipe, make_adapter
from tests.worker.model_harness import build_batch, tiny_gpu_llama
from tests.worker.test_lora_runtime import page_in_both_ways
from tests.worker.token_rows import flat
from worker.engine.events import Token
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.lora import delta
from worker.lora.adapter_set import load_adapters
from worker.main import build_engine
from worker.model.forward_batch import ForwardBatch
from worker.model.loader import attach_kv_cache, load_model
from worker.runner.req_table import ReqTable

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RECIPES = [
    AdapterRecipe("qv4", 4, ("q_proj", "v_proj"), seed=1, alpha=4.0),
    AdapterRecipe("mlp16", 16, ("gate_proj", "up_proj", "down_proj"), seed=2, alpha=16.0, rslora=True),
    AdapterRecipe("all64", 64, ALL, seed=3, alpha=32.0),
]
PROMPTS = [[1, 5, 9, 200, 13], list(range(100, 160)), [7, 8], [300]]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """(model folder, --lora_modules): a tiny Llama with peaked logits (see test_gpu_backend) and peft adapters."""
    folder = tmp_path_factory.mktemp("tiny-lora-gpu")
    ref = tiny_gpu_llama().eval()
    ref.save_pretrained(folder / "base")
    specs = []
    for recipe in RECIPES:
        make_adapter(ref, recipe, str(folder / recipe.name), [], 0)
        specs.append(f"{recipe.name}={folder / recipe.name}")
    return str(folder / "base"), specs


def engine_for(model_dir: str, specs: list[str], device: str, dtype: str, graphs: bool):
    settings = WorkerSettings(
        model=ModelSettings(model_dir=model_dir, max_req_total_len=512, lora_modules=specs),
        device=device,
        dtype=dtype,
        max_total_token_num=4096,
        running_max_req_size=16,
        cuda_graphs=graphs,
        graph_max_batch_size=16,
    )
    return build_engine(settings)


def greedy(lora_dir, device: str, graphs: bool, dtype: str = "float32") -> dict[str, list[int]]:
    engine = engine_for(*lora_dir, device, dtype, graphs)
    for name in [None, *(r.name for r in RECIPES)]:
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(max_new_tokens=12, ignore_eos=True)
            msg = GenerateRequest(id=f"{name}/{i}", prompt_ids=prompt, created_ms=0, params=params, adapter=name)
            engine.add(Req(msg=msg, inbox_id="0"))
    out: dict[str, list[int]] = {}
    while engine.has_work:
        for e in flat(engine.step()):
            if isinstance(e, Token):
                out.setdefault(e.request_id, []).append(e.token_id)
    return out


@pytest.mark.parametrize("grouped_from", [None, 1], ids=["per-token-decode", "grouped-decode"])
@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_tokens_with_adapters_equal_on_gpu_and_cpu(lora_dir, graphs, grouped_from, monkeypatch):
    """16 requests decode together: below delta.GROUPED_FROM through BGMV, and (every decode grouped
    by slot) through bgmv_grouped, in a captured graph too (the grouping runs inside the graph)."""
    if grouped_from is not None:
        monkeypatch.setattr(delta, "GROUPED_FROM", grouped_from)
    cpu = greedy(lora_dir, "cpu", False)
    assert all(cpu[f"{r.name}/{i}"] != cpu[f"None/{i}"] for r in RECIPES for i in range(2))  # adapters matter
    assert greedy(lora_dir, "cuda", graphs) == cpu


def prefill_logits(lora_dir, device: str, dtype: torch.dtype) -> torch.Tensor:
    """[adapters + 1, vocab]: one prompt under no adapter and under each adapter, in one prefill."""
    model_dir, specs = lora_dir
    model, _ = load_model(ModelSource("hf", model_dir), dtype, device)
    load_adapters(specs, model, max_rank=64)
    cache = attach_kv_cache(model, 1024, device)
    table, pool = ReqTable(8, 256, cache.hold_slot, device), TokenPool(1024)
    prompts = [PROMPTS[1]] * (len(specs) + 1)
    rows = [table.allocate_row() for _ in prompts]
    slots = [pool.allocate(len(p)) for p in prompts]
    for row, s in zip(rows, slots):
        table.write(row, 0, s)
    batch = build_batch(table.table, rows, [0] * len(prompts), prompts, slots)
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
    moved["lora_slots"] = torch.arange(len(prompts), dtype=torch.int32, device=device)  # 0: none, then each
    return model.forward(ForwardBatch(**moved)).float().cpu()


def test_bf16_logits_of_a_mixed_prefill_stay_near_the_reference(lora_dir):
    cpu = prefill_logits(lora_dir, "cpu", torch.float32)
    gpu = prefill_logits(lora_dir, "cuda", torch.bfloat16)
    scale = cpu.abs().max()
    error = (gpu - cpu).abs().max() / scale
    moved = min((cpu[i] - cpu[0]).abs().max() / scale for i in range(1, len(cpu)))  # each adapter vs base
    assert torch.isfinite(gpu).all()
    assert error < 0.05 and moved > 4 * error, (float(error), float(moved))


def test_a_staged_page_in_writes_the_slots_the_plain_copies_write_on_gpu(lora_dir):
    """worker.model.kernels.scatter_copy compiled, in bf16: the adapters' pages equal the copies'."""
    base, specs = lora_dir
    folders = dict(spec.split("=", 1) for spec in specs if not spec.startswith("all64"))  # rank 64: over MAX_RANK
    page_in_both_ways(base, folders, ["mlp16", "qv4", "mlp16", "qv4"], "cuda", torch.bfloat16)

"""The CUDA path against the CPU reference (runs only where a GPU is present).

Same weights, loaded twice: on CUDA (Triton attention, norm, rotary and
SiLU kernels, decode CUDA graphs) and on the CPU (the PyTorch reference).
"""

import dataclasses

import pytest
import torch

from shared.config import ModelSettings
from shared.model_files import ModelSource, resolve
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.worker.model_harness import build_batch, tiny_gpu_llama
from tests.worker.token_rows import flat
from worker.engine.events import Token
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.main import build_engine
from worker.model.forward_batch import ForwardBatch
from worker.model.loader import attach_kv_cache, load_model
from worker.runner.req_table import ReqTable

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gpu")
    tiny_gpu_llama().save_pretrained(folder)
    return str(folder)


def greedy(model_dir: str, device: str, prompts, max_new: int, graphs: bool) -> list[list[int]]:
    settings = WorkerSettings(
        model=ModelSettings(model_dir=model_dir, max_req_total_len=512),
        device=device,
        dtype="float32",
        max_total_token_num=4096,
        running_max_req_size=16,
        cuda_graphs=graphs,
        graph_max_batch_size=16,
    )
    engine = build_engine(settings)
    for i, prompt in enumerate(prompts):
        msg = GenerateRequest(
            id=str(i), prompt_ids=prompt, created_ms=0, params=SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        )
        engine.add(Req(msg=msg, inbox_id=f"{i}-0"))
    out: dict[str, list[int]] = {}
    while engine.has_work:
        for e in flat(engine.step()):
            if isinstance(e, Token):
                out.setdefault(e.request_id, []).append(e.token_id)
    return [out[str(i)] for i in range(len(prompts))]


def prefill_logits(model_dir: str, device: str, prompts: list[list[int]]) -> torch.Tensor:
    model, _ = load_model(ModelSource("hf", model_dir), torch.float32, device)
    cache = attach_kv_cache(model, 1024, device)
    cache.buffer.fill_(float("nan"))  # slots nobody wrote must never be read
    table, pool = ReqTable(8, 256, cache.hold_slot, device), TokenPool(1024)
    pool.allocate(7)  # so requests' slots do not start at 0
    rows, slots = [], []
    for prompt in prompts:
        rows.append(table.allocate_row())
        slots.append(pool.allocate(len(prompt)))
        table.write(rows[-1], 0, slots[-1])
    batch = build_batch(table.table, rows, [0] * len(prompts), prompts, slots)
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
    return model.forward(ForwardBatch(**moved)).float().cpu()


def test_logits_of_triton_backend_match_the_reference(tiny_dir):
    prompts = [[1, 5, 9, 200, 13], list(range(100, 160)), [7]]
    cpu, cuda = prefill_logits(tiny_dir, "cpu", prompts), prefill_logits(tiny_dir, "cuda", prompts)
    assert torch.isfinite(cuda).all()
    assert (cuda - cpu).abs().max() / cpu.abs().max() < 2e-2  # tf32 dots in the Triton kernels


@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_tokens_equal_on_gpu_and_cpu(tiny_dir, graphs):
    prompts = [[1, 5, 9, 200, 13], list(range(100, 160)), [7, 8], list(range(300, 301))]
    assert greedy(tiny_dir, "cuda", prompts, 16, graphs) == greedy(tiny_dir, "cpu", prompts, 16, False)


@pytest.mark.slow
def test_smollm2_greedy_text_is_identical_on_both_backends():
    try:
        source = resolve("default")
    except FileNotFoundError:
        pytest.skip("embedded model not installed")
    from shared.model_files import load_tokenizer

    tokenizer = load_tokenizer(source)
    questions = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about rain."]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    gpu = greedy("default", "cuda", prompts, 32, True)
    cpu = greedy("default", "cpu", prompts, 32, False)
    assert gpu == cpu
    assert "Paris" in tokenizer.decode(gpu[0])

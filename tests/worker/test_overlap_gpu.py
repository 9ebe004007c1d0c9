"""The overlapped engine on a GPU (runs only where one is present): Triton kernels, decode CUDA
graphs reading their input ids on the device, the sampled ids' copy to pinned memory landing a
step later. The same mixed workload as ``test_overlap`` publishes the same tokens and ends with
overlap on and off, each index once, and every slot comes back."""

from __future__ import annotations

import pytest
import torch

from shared.config import ModelSettings
from shared.worker_settings import WorkerSettings
from tests.worker.test_gpu_backend import tiny_dir  # noqa: F401 (fixture)
from tests.worker.test_overlap import count_device_id_decodes, run, workload
from worker.main import build_engine

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

EOS = list(range(0, 1000, 17))  # one id in 17 of the tiny model's 1,000 ends a request


def engine(model_dir: str, overlap: str, graphs: bool):
    settings = WorkerSettings(
        model=ModelSettings(model_dir=model_dir, max_req_total_len=512),
        device="cuda",
        dtype="float32",
        max_total_token_num=4096,
        running_max_req_size=16,
        cuda_graphs=graphs,
        graph_max_batch_size=16,
        overlap=overlap,
        eos_id=EOS,
    )
    return build_engine(settings)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_overlap_on_the_gpu_publishes_what_it_does_off(tiny_dir, graphs):  # noqa: F811
    plain = run(engine(tiny_dir, "off", graphs), workload(long=True))
    overlapped_engine = engine(tiny_dir, "on", graphs)
    assert overlapped_engine.overlap
    device_ids = count_device_id_decodes(overlapped_engine)
    overlapped = run(overlapped_engine, workload(long=True))
    assert overlapped == plain
    assert sum(reason == "stop" for _, reason in plain.values()) >= 2
    assert sum(device_ids) > len(device_ids) / 2
    slots = overlapped_engine.runner.slots
    assert slots.num_held == 0 and slots.available == overlapped_engine.limits.max_total_tokens

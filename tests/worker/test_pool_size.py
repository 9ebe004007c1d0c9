"""The KV pool's size on a GPU, alone and sharing the GPU with other workers (torch.cuda's memory query faked)."""

import pytest
import torch

from shared.worker_settings import WorkerSettings
from worker.main import pool_size
from worker.model.kv_cache import KVCache

GIB = 1 << 30


class Model(torch.nn.Module):
    """1 GiB of fp32 weights and a KV shape; nothing is run."""

    num_layers, num_kv_heads, head_dim, dtype = 4, 2, 64, torch.bfloat16

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(GIB // 4, device="meta"))


@pytest.fixture
def gpu(monkeypatch):
    memory = {"free": 70 * GIB, "total": 100 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (memory["free"], memory["total"]))
    return memory


def tokens(nbytes: float) -> int:
    return int(nbytes // KVCache.bytes_per_token(4, 2, 64, torch.bfloat16))


def test_alone_the_pool_takes_what_mem_fraction_leaves_free(gpu):
    assert pool_size(WorkerSettings(mem_fraction=0.9), Model(), torch.device("cuda")) == tokens(60 * GIB)


def test_a_shared_gpu_gives_each_worker_its_share_less_its_weights(gpu):
    settings = WorkerSettings(mem_fraction=0.9, gpu_share=0.25)
    # Its share is 22.5 GiB, less 1 GiB of weights: far less than the 60 GiB free now.
    assert pool_size(settings, Model(), torch.device("cuda")) == tokens(21.5 * GIB)
    gpu["free"] = 20 * GIB  # neighbours already hold most of it: never more than is free less the headroom
    assert pool_size(settings, Model(), torch.device("cuda")) == tokens(10 * GIB)

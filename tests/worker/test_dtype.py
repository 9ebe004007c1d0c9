"""``--dtype auto``: bf16 on a GPU and on a CPU that runs bf16 natively, fp32 on other CPUs."""

from __future__ import annotations

import torch

from shared.worker_settings import WorkerSettings
from worker.main import pick_dtype
from worker.model.layers import native_bf16


def test_auto_is_bf16_where_the_cpu_runs_bf16_natively(monkeypatch):
    monkeypatch.delenv("LIGHTQ_DTYPE", raising=False)  # the suite pins fp32 (tests/conftest.py)
    assert WorkerSettings().dtype == "auto"
    want = torch.bfloat16 if native_bf16() else torch.float32
    assert pick_dtype("auto", torch.device("cpu")) == want
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16  # a device object: no GPU needed


def test_a_dtype_named_is_that_dtype_everywhere():
    for device in ("cpu", "cuda"):
        assert pick_dtype("float32", torch.device(device)) == torch.float32
        assert pick_dtype("bfloat16", torch.device(device)) == torch.bfloat16
        assert pick_dtype("float16", torch.device(device)) == torch.float16


def test_the_suite_runs_fp32_unless_a_test_asks():
    """What tests/conftest.py sets: transformers' fp32 references hold on every CPU."""
    assert WorkerSettings().dtype == "float32"


def test_native_bf16_only_where_the_cpu_flags_say_so():
    """On Linux a yes from the probe is backed by /proc/cpuinfo (AVX-512 BF16 or AMX tiles). Not the
    converse: torch may say no where the flags say yes (AMX needs the kernel's permission), and then
    fp32 is the safe answer."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read().split()
    except OSError:
        return
    if native_bf16():
        assert "avx512_bf16" in flags or "amx_tile" in flags

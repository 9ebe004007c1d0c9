"""``lightq serve --workers M --tp N`` on a GPU host: each worker gets its own N GPUs."""

from __future__ import annotations

import pytest

from lightq.launcher import gpu_slices, worker_envs


def test_each_worker_gets_its_own_consecutive_gpus():
    env = {"LIGHTQ_TP": "2"}
    assert gpu_slices(env, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert gpu_slices({}, 3, ["4", "6", "7"]) == ["4", "6", "7"]  # tp 1, from CUDA_VISIBLE_DEVICES' own ids


def test_spare_gpus_stay_unused_and_too_few_fail_before_anything_starts():
    assert gpu_slices({"LIGHTQ_TP": "2"}, 1, ["0", "1", "2"]) == ["0,1"]
    with pytest.raises(SystemExit, match="needs 4 GPUs; 3 visible"):
        gpu_slices({"LIGHTQ_TP": "2"}, 2, ["0", "1", "2"])


def test_more_workers_than_gpus_share_them_and_split_their_memory():
    """--tp 1: round-robin, each worker told its part of the GPU (worker.main.pool_size uses it)."""
    assert gpu_slices({}, 4, ["0"]) == ["0"] * 4
    assert gpu_slices({}, 3, ["0", "1"]) == ["0", "1", "0"]
    envs = worker_envs({"LIGHTQ_TP": "1"}, 3, ["0", "1"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0"]
    assert [e.get("LIGHTQ_GPU_SHARE") for e in envs] == ["0.5", None, "0.5"]
    assert "LIGHTQ_GPU_SHARE" not in worker_envs({}, 2, ["0", "1"])[0]


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_no_gpus_or_a_pinned_device_leave_the_environment_alone(device):
    assert gpu_slices({}, 2, []) == [None, None]
    assert gpu_slices({"LIGHTQ_DEVICE": device}, 2, ["0", "1"]) == [None, None]


def test_worker_environments_carry_their_gpus_and_a_share_of_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    envs = worker_envs({"LIGHTQ_TP": "1", "PATH": "/bin"}, 2, ["2", "3"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "3"]
    assert all(e["OMP_NUM_THREADS"] == "4" and e["PATH"] == "/bin" for e in envs)
    assert "CUDA_VISIBLE_DEVICES" not in worker_envs({}, 2, [])[0]


def test_cpu_workers_keep_big_temporaries_in_the_heap():
    """glibc's malloc settings go to CPU workers only, and never override the environment's own."""
    cpu = worker_envs({"PATH": "/bin"}, 2, [])
    assert all(e["MALLOC_MMAP_THRESHOLD_"] == str(256 << 20) and e["PATH"] == "/bin" for e in cpu)
    assert worker_envs({"LIGHTQ_DEVICE": "cpu"}, 1, ["0"])[0]["MALLOC_TRIM_THRESHOLD_"] == str(1 << 30)
    assert worker_envs({"MALLOC_MMAP_THRESHOLD_": "1024"}, 1, [])[0]["MALLOC_MMAP_THRESHOLD_"] == "1024"
    for env in ({}, {"LIGHTQ_DEVICE": "cuda"}, {"LIGHTQ_DEVICE": "cuda:1"}):
        assert "MALLOC_MMAP_THRESHOLD_" not in worker_envs(env, 1, ["0"])[0]

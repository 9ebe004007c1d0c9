"""The dequantised-GGUF cache (worker.model.gguf_cache): the embedded SmolLM2 dequantised once, then
read back bit for bit; the same GGUF at another path (another clone's venv) hits; a changed GGUF
misses; a damaged file is dequantised again; an unwritable folder still loads."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from shared.model_files import resolve
from worker.model import gguf_cache
from worker.model.gguf_cache import cache_file, cached_weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> str:
    """A copy of the embedded GGUF, so its modification time can change."""
    path = str(tmp_path_factory.mktemp("gguf") / "smol.gguf")
    shutil.copyfile(resolve("default").path, path)
    return path


@pytest.fixture(scope="module")
def dequantised(smollm2_dequantised) -> dict[str, torch.Tensor]:
    """``gguf_weights`` of the embedded GGUF, this session's (tests/conftest.py): the copy above has
    the same bytes, so the same tensors."""
    return smollm2_dequantised


def never() -> gguf_cache.WeightStream:
    raise AssertionError("dequantised although the cache holds the file")


def test_a_cached_start_reads_the_same_tensors_and_a_changed_gguf_misses(gguf, dequantised, tmp_path):
    folder = str(tmp_path / "weights")
    first = dict(cached_weights(gguf, folder, lambda: iter(dequantised.items())))
    assert os.listdir(folder) == [os.path.basename(cache_file(folder, gguf))]  # no temporary left
    again = dict(cached_weights(gguf, folder, never))
    assert again.keys() == dequantised.keys() == first.keys()
    for name, tensor in dequantised.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name
    stale = cache_file(folder, gguf)
    with open(gguf, "r+b") as f:  # one byte of the last tensor's data changed, the size kept
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert cache_file(folder, gguf) != stale
    with pytest.raises(AssertionError, match="dequantised although"):
        dict(cached_weights(gguf, folder, never))  # a changed file is not read from the old copy
    small = {"w": torch.arange(6.0).reshape(2, 3)}
    assert torch.equal(dict(cached_weights(gguf, folder, lambda: iter(small.items())))["w"], small["w"])
    assert os.listdir(folder) == [os.path.basename(cache_file(folder, gguf))]  # the stale copy went


def test_the_same_gguf_elsewhere_reads_the_copy_a_first_start_kept(gguf, tmp_path):
    """A fresh clone's venv installs the same GGUF at a new path with a new modification time: its
    first start reads the copy another checkout's start kept (issue 33: it dequantised again)."""
    folder = str(tmp_path / "weights")
    small = {"w": torch.arange(4.0)}
    dict(cached_weights(gguf, folder, lambda: iter(small.items())))
    elsewhere = tmp_path / "another-venv" / os.path.basename(gguf)
    elsewhere.parent.mkdir()
    shutil.copyfile(gguf, elsewhere)  # a new file: its own inode and modification time
    os.utime(elsewhere, ns=(os.stat(gguf).st_atime_ns, os.stat(gguf).st_mtime_ns + 10**9))
    assert cache_file(folder, str(elsewhere)) == cache_file(folder, gguf)
    assert torch.equal(dict(cached_weights(str(elsewhere), folder, never))["w"], small["w"])
    os.utime(gguf)  # touched, not changed: still the same copy
    assert torch.equal(dict(cached_weights(gguf, folder, never))["w"], small["w"])


def test_a_damaged_file_is_dequantised_again_and_rewritten(gguf, tmp_path):
    folder = str(tmp_path)
    path = cache_file(folder, gguf)
    with open(path, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    small = {"w": torch.ones(4)}
    assert torch.equal(dict(cached_weights(gguf, folder, lambda: iter(small.items())))["w"], small["w"])
    assert torch.equal(dict(cached_weights(gguf, folder, never))["w"], small["w"])


def test_an_unwritable_folder_still_loads(gguf, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would be")
    small = {"w": torch.zeros(3) - 1}
    out = dict(cached_weights(gguf, str(blocked / "weights"), lambda: iter(small.items())))
    assert torch.equal(out["w"], small["w"])

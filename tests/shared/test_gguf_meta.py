"""A GGUF's config and tokenizer kept in --weights_cache (shared.gguf_meta): read back, they are what
the GGUF gives; a damaged or unwritable cache costs a build, never a start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shared import gguf_meta
from shared.model_files import load_config, load_tokenizer, resolve

TEXTS = ["Hello, world!", "  two spaces\tand a tab\n", "ünïcödé and emoji 🙂", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def test_the_embedded_tokenizer_and_config_read_back_are_the_ggufs(tmp_path, smollm2_tokenizer):
    source = resolve("default")
    built = load_tokenizer(source, str(tmp_path))  # built from the GGUF and kept
    kept = gguf_meta.meta_folder(str(tmp_path), source.path, "tokenizer")
    assert os.path.isfile(os.path.join(kept, "tokenizer.json"))
    read = load_tokenizer(source, str(tmp_path))  # read back from the folder
    for tokenizer in (built, read):
        assert tokenizer.get_vocab() == smollm2_tokenizer.get_vocab()
        assert tokenizer.all_special_tokens == smollm2_tokenizer.all_special_tokens
        assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (
            smollm2_tokenizer.eos_token_id,
            smollm2_tokenizer.bos_token_id,
        )
        for text in TEXTS:
            ids = smollm2_tokenizer.encode(text)
            assert tokenizer.encode(text) == ids
            assert tokenizer.decode(ids) == smollm2_tokenizer.decode(ids)
        want = smollm2_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == want

    config = load_config(source, str(tmp_path))
    assert os.path.isfile(os.path.join(gguf_meta.meta_folder(str(tmp_path), source.path, "config"), "config.json"))
    again = load_config(source, str(tmp_path))
    plain = load_config(source)  # built from the GGUF, nothing kept
    volatile = {"_name_or_path", "transformers_version"}
    want_config = {k: v for k, v in plain.to_dict().items() if k not in volatile}
    for each in (config, again):
        assert {k: v for k, v in each.to_dict().items() if k not in volatile} == want_config


NO_TORCH = """
import sys
from lightq.cli import parser
from shared.model_files import load_tokenizer, resolve

parser()  # what every lightq process builds first
tokenizer = load_tokenizer(resolve("default"), sys.argv[1])
assert tokenizer.decode(tokenizer.encode("Hello, world!")) == "Hello, world!"
import producer.main  # the producer's app and routes, and what it reads of the vocabulary at start
from producer.api.vocabulary import Vocabulary

assert Vocabulary(tokenizer).longest_token_chars()
print(sorted(name for name in ("torch", "xgrammar") if name in sys.modules))
"""


def test_a_kept_tokenizer_and_the_cli_load_without_torch(tmp_path, smollm2_tokenizer):
    """The processes that only tokenise or route (a worker's publishers, the router, the producer) start
    without torch: it cost each ~1.3 s of CPU and ~200 MB, when the CLI's parser imported it, the
    tokenizer came through AutoTokenizer (``shared.model_files.tokenizer_from_folder``), and the
    producer imported xgrammar for the logprobs' bytes (``producer.api.vocabulary``)."""
    source = resolve("default")
    smollm2_tokenizer.save_pretrained(gguf_meta.meta_folder(str(tmp_path), source.path, "tokenizer"))  # as kept
    done = subprocess.run([sys.executable, "-c", NO_TORCH, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


class Made:
    """A stand-in for a config: what ``cached`` needs of one (save_pretrained, and a reader)."""

    def __init__(self, value: int):
        self.value = value

    def save_pretrained(self, folder: str) -> None:
        with open(os.path.join(folder, "made.json"), "w") as f:
            json.dump({"value": self.value}, f)

    @classmethod
    def load(cls, folder: str) -> Made:
        with open(os.path.join(folder, "made.json")) as f:
            return cls(json.load(f)["value"])


@pytest.fixture
def gguf(tmp_path) -> str:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)))
    return str(path)


def test_built_once_then_read_and_a_changed_gguf_builds_again(tmp_path, gguf):
    cache, builds = str(tmp_path / "cache"), []

    def build() -> Made:
        builds.append(1)
        return Made(len(builds))

    assert gguf_meta.cached(gguf, cache, "made", build, Made.load).value == 1
    assert gguf_meta.cached(gguf, cache, "made", build, Made.load).value == 1  # read back, not built
    assert len(builds) == 1
    assert [name for name in os.listdir(cache) if name.startswith(".writing-")] == []  # no temporary left
    with open(gguf, "ab") as f:
        f.write(b"another GGUF")
    assert gguf_meta.cached(gguf, cache, "made", build, Made.load).value == 2  # a new name: built
    assert len(os.listdir(cache)) == 2


def test_a_damaged_folder_is_built_again_and_replaced(tmp_path, gguf, caplog):
    cache = str(tmp_path / "cache")
    folder = gguf_meta.meta_folder(cache, gguf, "made")
    os.makedirs(folder)
    with open(os.path.join(folder, "made.json"), "w") as f:
        f.write("{not json")
    assert gguf_meta.cached(gguf, cache, "made", lambda: Made(7), Made.load).value == 7
    assert "unreadable" in caplog.text
    assert Made.load(folder).value == 7  # the rebuilt one kept in its place


def test_a_cache_that_cannot_be_written_or_none_only_costs_the_build(tmp_path, gguf, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert gguf_meta.cached(gguf, str(blocked / "cache"), "made", lambda: Made(3), Made.load).value == 3
    assert "could not keep" in caplog.text
    assert gguf_meta.cached(gguf, "", "made", lambda: Made(4), Made.load).value == 4  # '': nothing kept


def test_a_folder_another_process_kept_first_wins(tmp_path, gguf):
    """Two processes building at once: the second's rename fails on the first's folder; both serve."""
    cache = str(tmp_path / "cache")
    folder = gguf_meta.meta_folder(cache, gguf, "made")

    def build_while_another_lands() -> Made:
        os.makedirs(folder)
        Made(1).save_pretrained(folder)
        return Made(2)

    assert gguf_meta.cached(gguf, cache, "made", build_while_another_lands, Made.load).value == 2
    assert Made.load(folder).value == 1
    assert os.listdir(cache) == [os.path.basename(folder)]  # no temporary left behind

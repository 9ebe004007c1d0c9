"""``--model_dir`` forms the producer and worker resolve alike (``shared.model_files``)."""

from __future__ import annotations

import pytest

from bench.engine.shapes import word_tokenizer
from shared.model_files import load_tokenizer, resolve, served_name


def test_counting_with_a_tokenizer_folder_needs_no_model(tmp_path):
    """``counting:<dir>``: the counting stand-in with the tokenizer in <dir> (no weights, no GGUF),
    so a stack bench can run where the 98 MB default model cannot travel."""
    word_tokenizer(300, str(tmp_path))
    source = resolve(f"counting:{tmp_path}")
    assert (source.kind, source.path) == ("counting", str(tmp_path))
    tokenizer = load_tokenizer(source)
    assert len(tokenizer) == 300 and tokenizer.decode(tokenizer.encode("w7 w299")) == "w7 w299"
    assert served_name(f"counting:{tmp_path}") == tmp_path.name


def test_counting_with_a_folder_without_a_tokenizer_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        resolve(f"counting:{tmp_path}")


def test_plain_counting_is_unchanged():
    assert resolve("counting").path == "counting"

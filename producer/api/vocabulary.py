"""A token id as the OpenAI routes show it in logprobs: its text and its raw bytes.

A byte-level tokenizer splits a character it has no token for (an emoji, much CJK) into tokens
of a byte or two each; decoded alone, each is U+FFFD. OpenAI's ``bytes`` field exists for this:
a client rebuilds the text from the tokens' bytes. They come from xgrammar's decoded vocabulary
(it knows byte-level, byte-fallback and raw vocabularies), built at the first use in a process,
~0.4 s for SmolLM2's 49,152 tokens, so an app that never answers logprobs never pays it. xgrammar
is imported there too, not at start-up: it imports torch (through tvm_ffi), ~2 s and ~200 MB a
producer process. A chat route asking for logprobs builds it on a thread first (``prepare``), so
neither the import nor the build stalls the event loop's other streams.
"""

from __future__ import annotations

import asyncio
from typing import Any


class Vocabulary:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes: list[bytes] | None = None

    def longest_token_chars(self) -> int | None:
        """An upper bound on the characters of text one token stands for: its longest entry (byte-
        level BPE writes a byte a character, so a token's text has at most that many; added and
        special tokens included). None for a tokenizer without a vocabulary to read."""
        get_vocab = getattr(self.tokenizer, "get_vocab", None)
        return max(map(len, get_vocab() if get_vocab is not None else ()), default=0) or None

    async def prepare(self) -> None:
        """The raw bytes built on a thread, once (``raw`` builds them in place where nothing waits on it)."""
        if self._bytes is None:
            await asyncio.to_thread(self._build)

    def _build(self) -> list[bytes]:
        import xgrammar as xgr

        self._bytes = [bytes(b) for b in xgr.TokenizerInfo.from_huggingface(self.tokenizer).decoded_vocab]
        return self._bytes

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def raw(self, token_id: int) -> list[int]:
        """The token's bytes (its text's UTF-8 for an id past the decoded vocabulary)."""
        vocab = self._bytes if self._bytes is not None else self._build()
        if 0 <= token_id < len(vocab):
            return list(vocab[token_id])
        return list(self.text(token_id).encode())

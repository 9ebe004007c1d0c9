import pytest

from worker.service.detokenizer import IncrementalDecoder, resumed_decoder


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer  # loaded once a session (tests/conftest.py)


@pytest.mark.parametrize(
    "text",
    [
        " Paris is the capital of France.",
        "Multi-byte: 你好，世界 and emoji 🎉🚀 and accents café naïve.",
        "\n\nlines\n  indented\ttabs",
    ],
)
def test_streamed_pieces_join_to_the_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer, prompt)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_a_resumed_decoder_continues_the_text(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    first = IncrementalDecoder(tokenizer, [])
    head = "".join(first.push(i) for i in ids[:4])
    second = resumed_decoder(tokenizer, [], ids[:4])
    tail = "".join(second.push(i) for i in ids[4:]) + second.flush()
    assert head + tail == tokenizer.decode(ids)


@pytest.mark.parametrize("text", ["Hi 😀 and 日本語 ok", "日本語と😀 日本語と😀 ", "a \x80\xff invalid \ufffd bytes"])
def test_a_decoder_resumed_at_any_cut_gives_the_uninterrupted_text(tokenizer, text):
    """Cut at every token, inside multi-byte characters too (a migration or a pause can fall
    anywhere): what the first attempt emitted plus what the resumed decoder emits is the whole
    text. A decoder started after the cut took the held bytes as emitted and lost the character."""
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text)
    whole = IncrementalDecoder(tokenizer, prompt)
    want = "".join(whole.push(i) for i in ids) + whole.flush()
    assert any(len(tokenizer.decode(ids[:k])) < len(text) for k in range(1, len(ids)))  # cuts inside characters
    for cut in range(len(ids) + 1):
        first = IncrementalDecoder(tokenizer, prompt)
        head = "".join(first.push(i) for i in ids[:cut])
        second = resumed_decoder(tokenizer, prompt, ids[:cut])
        tail = "".join(second.push(i) for i in ids[cut:]) + second.flush()
        assert head + tail == want, cut

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

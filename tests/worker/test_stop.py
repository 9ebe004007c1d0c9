import random

import pytest

from worker.service.stop import StopMatcher


def run(stops, pieces, armed_from=0):
    """(emitted text, index of the piece that stopped or None), flushing at the end."""
    matcher = StopMatcher(stops)
    out = []
    for index, piece in enumerate(pieces):
        text, hit = matcher.push(piece, armed=index + 1 >= armed_from)
        out.append(text)
        if hit:
            return "".join(out), index
    return "".join(out) + matcher.flush(), None


def test_a_stop_split_across_pieces_is_caught_and_not_emitted():
    matcher = StopMatcher(["<|end|>"])
    assert matcher.push("Hello <") == ("Hello ", False)
    assert matcher.push("|e") == ("", False)
    assert matcher.push("nd|> tail") == ("", True)
    assert matcher.push("more") == ("", True)  # nothing after a stop
    assert matcher.flush() == ""


def test_stop_inside_one_piece_and_earliest_wins():
    assert run(["\n\n"], ["one\n\ntwo"]) == ("one", 0)
    assert run(["b", "a"], ["xxab"]) == ("xx", 0)
    assert run(["cd", "abcdef"], ["ab", "cd"]) == ("ab", 1)


def test_a_false_start_is_released():
    matcher = StopMatcher(["abc"])
    assert matcher.push("xa") == ("x", False)
    assert matcher.push("b") == ("", False)
    assert matcher.push("d") == ("abd", False)
    assert matcher.push("ab") == ("", False)
    assert matcher.flush() == "ab"  # the output ended for another reason: held text goes out


def test_overlapping_prefixes():
    assert run(["aab"], ["a", "a", "a", "b", "z"]) == ("a", 3)
    assert run(["abab"], ["ab", "ab", "a", "b"]) == ("", 1)
    assert run(["aXb"], ["a", "a", "X", "b"]) == ("a", 3)


def test_unarmed_pieces_pass_through():
    # Before min_new_tokens nothing is matched or held (vLLM's rule).
    assert run(["stop"], ["stop", " then stop"], armed_from=2) == ("stop then ", 1)
    assert run(["ab"], ["a", "b", "ab"], armed_from=3) == ("ab", 2)


def test_without_stops_everything_passes():
    matcher = StopMatcher(["", ""])
    assert not matcher
    assert matcher.push("anything") == ("anything", False)


def reference(stops, pieces):
    """Plain search: stop at the first piece after which some stop string is complete,
    emitting the text before the earliest stop string complete by then."""
    seen = ""
    for index, piece in enumerate(pieces):
        seen += piece
        starts = [seen.find(s) for s in stops if s in seen]
        if starts:
            return seen[: min(starts)], index
    return seen, None


@pytest.mark.parametrize("seed", range(200))
def test_random_splits_match_a_plain_search(seed):
    rng = random.Random(seed)
    alphabet = "ab\n<|>"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(1, len(text)), 15))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert run(stops, pieces) == reference(stops, pieces)

"""Stop strings matched on the detokenised text, never emitted.

A stop string can be split across tokens ("<|" + "end|>") or sit inside one
token's text ("x\\n\\ny"). So the matcher sees the text stream, not tokens:
it holds back the longest tail of the text that could still be the start of
a stop string, and when a stop string completes it releases the text before
it and reports the stop. Invariant: ``held`` never contains a whole stop
string, so only text ending in the newest piece can complete one.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))  # unique, non-empty, in order
        self.held = ""
        self.stopped = False

    def __bool__(self) -> bool:
        return bool(self.stops)

    def push(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """Add the next piece of text; return (text safe to emit now, whether a stop completed).

        ``armed=False`` (before min_new_tokens): nothing is matched or held, as
        vLLM skips stop checks until the minimum is out.
        """
        if self.stopped:
            return "", True
        buffer = self.held + text
        if not armed:
            self.held = ""
            return buffer, False
        first = self._first_match(buffer)
        if first is not None:
            self.held, self.stopped = "", True
            return buffer[:first], True
        keep = self._partial_tail(buffer)
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held text, when the output ends for another reason (EOS, length)."""
        text, self.held = self.held, ""
        return "" if self.stopped else text

    def _first_match(self, buffer: str) -> int | None:
        # A match must end in the new text, so the search starts where that is still possible.
        starts = [buffer.find(s, max(0, len(self.held) - len(s) + 1)) for s in self.stops]
        found = [i for i in starts if i >= 0]
        return min(found) if found else None

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            # Only suffixes starting with stop[0] can qualify: jump between its occurrences.
            i = buffer.find(stop[0], max(0, len(buffer) - len(stop) + 1))
            while i >= 0 and len(buffer) - i > best:
                if stop.startswith(buffer[i:]):
                    best = len(buffer) - i
                    break
                i = buffer.find(stop[0], i + 1)
        return best

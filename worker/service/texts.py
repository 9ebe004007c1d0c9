"""A publisher's text state: per running sample, its incremental decoder and its stop matcher.

Stop strings are matched on the text (``worker.service.stop``): a token whose
text completes one ends its sample there (finish_reason "stop", text up to
the stop string). Text a stop string could still complete is held back (the
token's text is empty meanwhile) and released when the sample ends
otherwise. A resumed sample (its earlier attempt emitted tokens) gets its
decoder and matcher back in the state that attempt left them in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.schemas import FinishReason, GenerateRequest
from worker.engine.events import Token
from worker.service.detokenizer import IncrementalDecoder, resumed_decoder
from worker.service.stop import StopMatcher

Sample = tuple[str, int]  # (request id, choice)


@dataclass
class _Output:
    decoder: IncrementalDecoder
    matcher: StopMatcher
    min_new_tokens: int = 0


@dataclass(frozen=True)
class Text:
    """One token's text, and how its sample ends with it (``reason`` None: it goes on)."""

    text: str
    reason: FinishReason | None
    stopped_here: bool  # a stop string ended it while the engine runs it on: the engine must be told


def _matching(matcher: StopMatcher, min_new_tokens: int) -> Callable[[int, str], None]:
    """Each replayed piece (token ``index``'s text) into the matcher, as the attempt pushed it."""

    def push(index: int, piece: str) -> None:
        matcher.push(piece, armed=index + 1 >= min_new_tokens)

    return push


class Texts:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.outputs: dict[Sample, _Output] = {}

    def start(self, msg: GenerateRequest) -> None:
        """Each open sample after the tokens it emitted before (a resumed request)."""
        for choice in msg.open_choices:
            emitted = msg.emitted(choice)
            matcher = StopMatcher(msg.params.stop_sequences)
            # What the earlier attempt held back (a character's first bytes, text a stop string
            # could complete) rebuilt from the same tokens: same pieces, same state. Its emitted
            # text is discarded (the client has it); a stop it had completed would have ended the
            # request, so none completes here.
            replay = _matching(matcher, msg.params.min_new_tokens) if matcher else None
            decoder = resumed_decoder(self.tokenizer, msg.prompt_ids, emitted, replay)
            self.outputs[(msg.id, choice)] = _Output(decoder, matcher, msg.params.min_new_tokens)

    def token(self, event: Token) -> Text:
        """The token's text; a sample that ends with it is forgotten."""
        sample = (event.request_id, event.choice)
        output = self.outputs[sample]
        text = output.decoder.push(event.token_id)
        reason = event.finish_reason
        if reason is not None:
            text += output.decoder.flush()
        stopped_here = False
        if output.matcher:
            text, hit = output.matcher.push(text, armed=event.index + 1 >= output.min_new_tokens)
            if hit:
                stopped_here = reason is None  # the engine still runs it: it must be told
                reason = "stop"
            elif reason is not None:
                text += output.matcher.flush()
        if reason is not None:
            del self.outputs[sample]
        return Text(text, reason, stopped_here)

    def drop(self, sample: Sample) -> bool:
        """Forget a sample that ended without a token; whether it was running."""
        return self.outputs.pop(sample, None) is not None

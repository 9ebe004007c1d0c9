"""The position rules of attention (ALiBi, sliding window, causality), stated once.

Its own module because both the PyTorch backend (``worker.model.attention``)
and the Triton kernels' references use it: kept in either, the other would
import it back (an import circle).
"""

from __future__ import annotations

import torch


def position_scores(
    scores: torch.Tensor, rel: torch.Tensor, alibi_slopes: torch.Tensor | None = None, window: int | None = None
) -> torch.Tensor:
    """The one statement of the position rules, shared by the PyTorch backend and the kernels' references.

    scores [Q, Hq, L] fp32, already scaled; rel [Q, L] = key position - query
    position. Adds ALiBi ``slope[h] * rel`` (<= 0 where visible: the same
    softmax as BLOOM's ``slope * key_pos``, as softmax ignores a per-row
    shift, but small at any context length), and sets -inf where the key is in
    the future (rel > 0) or has left the window (rel <= -window).
    """
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.float()[None, :, None] * rel[:, None, :].float()
    hidden = rel > 0
    if window is not None:
        hidden = hidden | (rel <= -window)
    return scores.masked_fill(hidden[:, None, :], float("-inf"))

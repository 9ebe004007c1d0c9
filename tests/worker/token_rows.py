"""A forward's ``Tokens`` record as rows and back, for tests that read or build events by token."""

from __future__ import annotations

from worker.engine.events import Event, Token, Tokens


def pack(rows: list[Token]) -> Tokens:
    """The record of these rows (the inverse of ``rows``)."""
    return Tokens(
        [t.request_id for t in rows],
        [t.choice for t in rows],
        [t.index for t in rows],
        [t.token_id for t in rows],
        [t.logprob for t in rows],
        {i: t.finish_reason for i, t in enumerate(rows) if t.finish_reason is not None},
        {i: t.top for i, t in enumerate(rows) if t.top is not None},
    )


def rows(tokens: Tokens) -> list[Token]:
    return [
        Token(
            tokens.request_ids[i],
            tokens.indexes[i],
            tokens.token_ids[i],
            tokens.logprobs[i],
            tokens.reasons.get(i),
            tokens.choices[i],
            tokens.tops.get(i),
        )
        for i in range(len(tokens))
    ]


def flat(events: list[Event]) -> list[Event | Token]:
    """``events`` with each ``Tokens`` record spread into its rows."""
    return [item for event in events for item in (rows(event) if isinstance(event, Tokens) else [event])]

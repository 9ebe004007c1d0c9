"""shared.log_limit: a failure repeated on every pass of a loop is one line every few seconds."""

from __future__ import annotations

import logging

from shared.log_limit import LogLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_repeats_are_held_back_and_counted(caplog):
    clock = Clock()
    limiter = LogLimiter(logging.getLogger("test.log_limit"), every_s=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.log_limit"):
        written = []
        for _ in range(300):  # a busy loop: 300 failed steps within a second
            written.append(limiter.warning("Redis unreachable (%s)", "refused"))
            clock.now += 0.003
        assert written.count(True) == 1
        clock.now += 5.0
        assert limiter.warning("Redis unreachable (%s)", "refused")
        assert limiter.warning("another message")  # each message has its own slot
        assert not limiter.warning("Redis unreachable (%s)", "refused")
        limiter.reset()
        assert limiter.warning("Redis unreachable (%s)", "refused")  # a new outage is reported at once
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "Redis unreachable (refused)"
    assert lines[1].startswith("Redis unreachable (refused) (and 299 more like it in the last")
    assert lines[2] == "another message"
    assert "recovered" in lines[3] and "1 repeated" in lines[3] and lines[4] == "Redis unreachable (refused)"
    assert len(lines) == 5

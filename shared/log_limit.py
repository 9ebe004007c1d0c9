"""Rate-limited logging for loops that fail the same way on every pass (a Redis outage).

A busy loop that logs each failed step writes hundreds of lines a second
during an outage. ``LogLimiter`` lets the first line of each message through,
then at most one every ``every_s`` seconds, saying how many it held back; the
loop calls ``reset()`` when it works again, so the next outage is reported at
once (with how many lines the last one held back, if any, in a closing line).

Usage (one limiter per loop, kept by its owner; no module-level state)::

    outage_log = LogLimiter(log, every_s=5.0)
    ...
    except redis.ConnectionError as exc:
        outage_log.warning("Redis unreachable (%s)", exc)
    ...
    outage_log.reset()  # after a step that worked
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Slot:
    last_s: float  # when this message was last written
    held: int = 0  # lines held back since then


class LogLimiter:
    """Per message (its format string): the first line, then one per ``every_s`` seconds."""

    def __init__(
        self, logger: logging.Logger, every_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._slots: dict[str, _Slot] = {}

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Write the line unless this message was written less than ``every_s`` ago; whether it was."""
        now = self.clock()
        slot = self._slots.get(msg)
        if slot is not None and now - slot.last_s < self.every_s:
            slot.held += 1
            return False
        if slot is not None and slot.held:
            self.logger.log(
                level, f"{msg} (and %d more like it in the last %.0f s)", *args, slot.held, now - slot.last_s
            )
        else:
            self.logger.log(level, msg, *args)
        self._slots[msg] = _Slot(now)
        return True

    def warning(self, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, msg, *args)

    def reset(self) -> None:
        """The failure is over: say how many lines the last stretch held back, and forget it."""
        held = sum(slot.held for slot in self._slots.values())
        if held:
            self.logger.info("recovered (%d repeated log lines were held back)", held)
        self._slots.clear()

"""How long a test waits for something that must happen: a hang guard, never a measurement.

A test that gives an event (a process up, a stop reported, KV tokens freed, a worker's exit) a
deadline on the clock fails whenever a loaded machine is slower than its author's: issue 33 item 6,
a publisher test's 60 s wait failed in a full ``make test`` on two busy cores and passed alone.
Wait on the event itself where there is one to wait on; where a test polls for it, bound the poll
by ``MUST_HAPPEN_S``: far above any machine's slowness, below pytest's own timeout (pyproject's
600 s a test), so a real hang still fails with the test's own message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

MUST_HAPPEN_S = 300.0


async def loop_turns_during(work: Awaitable[T]) -> tuple[T, int]:
    """``work``'s result, and how many turns another task on the event loop got while it ran: 0 when
    ``work`` held the loop throughout (no await that suspends)."""
    turns, done = 0, False

    async def other_client() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_client())
    await asyncio.sleep(0)
    before = turns
    try:
        result = await work
    finally:
        during, done = turns - before, True
        await task
    return result, during

"""How long a test waits for something that must happen: a hang guard, never a measurement.

A test that gives an event (a process up, a stop reported, KV tokens freed, a worker's exit) a
deadline on the clock fails whenever a loaded machine is slower than its author's: issue 33 item 6,
a publisher test's 60 s wait failed in a full ``make test`` on two busy cores and passed alone.
Wait on the event itself where there is one to wait on; where a test polls for it, bound the poll
by ``MUST_HAPPEN_S``: far above any machine's slowness, below pytest's own timeout (pyproject's
600 s a test), so a real hang still fails with the test's own message.
"""

MUST_HAPPEN_S = 300.0

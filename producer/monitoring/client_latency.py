"""What clients see of their requests, observed as each chunk reaches this producer.

The stream hub (``producer.streams.stream_hub``) calls ``join`` when a reader starts
following a request, ``arrived`` with every batch of chunks its XREAD
returns (one clock reading per batch), and ``leave`` when the reader is
done. From those, on this process's monotonic clock:

- time to first token: join -> the first token of any sample;
- inter-token latency: the gap between two deliveries of new tokens of one
  sample (a run of several tokens arrives as one delivery, as vLLM and
  SGLang count the gaps between streamed chunks);
- end-to-end: join -> the last chunk that ended a sample, observed at
  ``leave`` if anything ended (a client that left early has no end);
- ``generation_tokens`` (new tokens delivered) and ``requests_ended{status}``.

Only readers that start at the beginning of a stream are timed (a resume
after ``Last-Event-ID`` is a request already counted). The join is within
microseconds of the enqueue on the streaming routes, so it stands for the
request's arrival; tokenising before it is not included. A reader that
replays an old request from the beginning (``GET /v1/requests/{id}/stream``
long after it was written) would read as instant: a chunk whose entry id
(Redis's clock) is older than the join by more than ``REPLAY_SLACK_MS``
marks it as a replay, and it is not observed (hosts' clocks assumed within
that of each other, as NTP keeps them). Submit-and-poll requests that no
client streams, and batch jobs (rq), are not observed here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from producer.monitoring.metrics import ProducerMetrics
from shared.chunk_schemas import ChunkRun

REPLAY_SLACK_MS = 1000
START = "0-0"
STATUS_BY_REASON = {
    "stop": "finished",
    "length": "finished",
    "cancelled": "cancelled",
    "error": "failed",
    "expired": "expired",
}


@dataclass
class _Timing:
    joined: float  # monotonic seconds when the reader joined
    joined_wall_ms: int  # the same moment on the wall clock, to tell replays (entry ids are Redis ms)
    next_index: dict[int, int] = field(default_factory=dict)  # per sample: the next new index
    last_token: dict[int, float] = field(default_factory=dict)  # per sample: arrival of its last token
    first_token: float | None = None
    ended: float | None = None  # arrival of the latest chunk that ended a sample
    status: str | None = None


class ClientLatency:
    def __init__(self, metrics: ProducerMetrics) -> None:
        self.metrics = metrics
        self._timings: dict[str, _Timing] = {}  # request id -> its timing while a reader follows it

    def join(self, request_id: str, cursor: str) -> None:
        if cursor == START and request_id not in self._timings:
            self._timings[request_id] = _Timing(time.monotonic(), int(time.time() * 1000))

    def arrived(self, request_id: str, entries: list[tuple[str, ChunkRun]], now: float) -> None:
        """A batch of ``(entry id, run)`` read at ``now`` (monotonic); repeats are not new."""
        timing = self._timings.get(request_id)
        if timing is None:
            return
        for entry_id, run in entries:
            if _is_replay(timing, entry_id):  # written before this reader came: nothing it waited for
                del self._timings[request_id]
                return
            self._observe(timing, run, now)

    def _observe(self, timing: _Timing, run: ChunkRun, now: float) -> None:
        choice = run.choice
        new = run.index + len(run.token_ids) - max(run.index, timing.next_index.get(choice, 0))
        if new > 0:
            timing.next_index[choice] = run.index + len(run.token_ids)
            self.metrics.generation_tokens.inc(new)
            if timing.first_token is None:
                timing.first_token = now
                self.metrics.ttft.observe(now - timing.joined)
            if choice in timing.last_token:
                self.metrics.itl.observe(now - timing.last_token[choice])
            timing.last_token[choice] = now
        if run.finished:
            timing.ended = now
            timing.status = STATUS_BY_REASON.get(run.finish_reason or "", "finished")

    def leave(self, request_id: str) -> None:
        timing = self._timings.pop(request_id, None)
        if timing is None or timing.ended is None:
            return
        self.metrics.e2e.observe(timing.ended - timing.joined)
        self.metrics.ended.labels(status=timing.status).inc()


def _is_replay(timing: _Timing, entry_id: str) -> bool:
    return int(entry_id.partition("-")[0]) < timing.joined_wall_ms - REPLAY_SLACK_MS

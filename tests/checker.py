"""A Jepsen-style checker for the counting model: every request's tokens are known in advance
(``worker.model.counting_model.expected_tokens``), so what a client got can be judged token by token.

``Burst`` streams ``requests`` requests at once through ``/generate_stream`` (each with its own last
prompt token), records every event a client saw with its arrival time, and ``check`` judges them:

- **ended**: the stream closed with a final event (``details.finish_reason``);
- **refused**: a request answered with an error status instead of a stream (a clear 503 while the
  control plane fails over): never accepted, so not lost;
- **lost**: an accepted request that did not end, or ended with fewer tokens than asked;
- **duplicated**: an index delivered twice (an event whose index was seen before);
- **wrong**: a token that differs from the one the request must produce at its index, or out of order;
- **longest gap**: the longest wait between two events of one request, over all requests: with a fault
  injected mid-burst, the time the pool took to recover, as a client saw it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from worker.model.counting_model import COUNTING_VOCAB, expected_tokens


@dataclass
class Stream:
    first: int  # the prompt's last token: what the counting model counts on from
    events: list[tuple[float, int, int]] = field(default_factory=list)  # (arrival, index, token id)
    finish_reason: str | None = None
    error: str | None = None
    refused: bool = False  # answered with an error status, not a stream
    request_id: str | None = None  # the pool's id for it (X-Request-Id), to look a lost one up


@dataclass(frozen=True)
class Report:
    sent: int
    refused: int
    ended: int
    lost: int
    duplicated: int
    wrong: int
    longest_gap_s: float

    def line(self) -> str:
        return (
            f"sent {self.sent}, refused {self.refused}, ended {self.ended}, lost {self.lost}, "
            f"duplicated {self.duplicated}, wrong {self.wrong}, longest gap {self.longest_gap_s:.2f} s"
        )


@dataclass
class Burst:
    http: str
    requests: int = 40
    new_tokens: int = 60
    first_token: int = 1000
    timeout_s: float = 300.0
    streams: list[Stream] = field(default_factory=list)

    async def run(self) -> list[Stream]:
        self.streams = [Stream(self.first_token + i) for i in range(self.requests)]
        limits = httpx.Limits(max_connections=self.requests + 4)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            await asyncio.gather(*(self._one(client, s) for s in self.streams))
        return self.streams

    async def _one(self, client: httpx.AsyncClient, stream: Stream) -> None:
        body = {"inputs": [1, stream.first], "parameters": {"max_new_tokens": self.new_tokens, "ignore_eos": True}}
        try:
            async with client.stream("POST", f"{self.http}/generate_stream", json=body) as response:
                if response.status_code != 200:
                    stream.refused = True
                    stream.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                    return
                stream.request_id = response.headers.get("x-request-id")
                index = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    event = json.loads(line[5:])
                    token = event.get("token") or {}
                    if token.get("id") is not None:
                        stream.events.append((time.monotonic(), index, token["id"]))
                        index += 1
                    if event.get("finished"):  # LightLLM's last event: finished, with its finish_reason
                        stream.finish_reason = event.get("finish_reason") or "?"
        except httpx.HTTPError as exc:
            stream.error = f"{type(exc).__name__}: {exc}"

    def check(self) -> Report:
        return check(self.streams, self.new_tokens)

    def lost(self) -> list[Stream]:
        """The accepted streams that did not end with every token."""
        want = self.new_tokens
        return [s for s in self.streams if not s.refused and (s.finish_reason is None or len(s.events) < want)]


def check(streams: list[Stream], new_tokens: int) -> Report:
    ended = lost = duplicated = wrong = refused = 0
    gap = 0.0
    for stream in streams:
        if stream.refused:
            refused += 1
            continue
        want = expected_tokens(stream.first, new_tokens, COUNTING_VOCAB)
        got = [token for _, _, token in stream.events]
        ended += stream.finish_reason is not None
        # An SSE event carries no index: a repeat shows as the expected sequence restarting, a loss
        # as a hole. Walk both: each got token must be the next expected one.
        position = 0
        for token in got:
            if position < len(want) and token == want[position]:
                position += 1
            elif token in want[:position]:
                duplicated += 1
            else:
                wrong += 1
        if stream.finish_reason is None or position < len(want):
            lost += 1
        times = [t for t, _, _ in stream.events]
        gap = max([gap, *(b - a for a, b in zip(times, times[1:]))])
    return Report(len(streams), refused, ended, lost, duplicated, wrong, gap)


def main() -> None:
    """``python -m tests.checker URL --requests N --new-tokens M --first F``: a burst from wherever it
    runs (a host's network namespace: tests/integration/test_host_faults.py), its report as JSON."""
    import argparse
    from dataclasses import asdict

    parser = argparse.ArgumentParser()
    parser.add_argument("http")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=60)
    parser.add_argument("--first", type=int, default=1000)
    args = parser.parse_args()
    burst = Burst(args.http, requests=args.requests, new_tokens=args.new_tokens, first_token=args.first)
    asyncio.run(burst.run())
    print(json.dumps(asdict(burst.check())), flush=True)


if __name__ == "__main__":
    main()

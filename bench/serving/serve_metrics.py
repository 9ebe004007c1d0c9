"""The serving benchmark's numbers, defined as vLLM's ``calculate_metrics`` defines them.

Per request: TTFT = send -> first streamed chunk; E2E = send -> last chunk;
TPOT = (E2E - TTFT) / (output tokens - 1) for requests with more than one
token; ITL = every gap between consecutive chunks, pooled over requests.
Percentiles are numpy's (linear interpolation). Goodput, vLLM's sense:
requests meeting every SLO given (``ttft``, ``tpot``, ``e2el``, in ms) per
second of the run; the Past-Future paper's sense: prompt + output tokens of
requests meeting TTFT and MTPOT (their largest gap) per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el", "mtpot")


@dataclass
class Outcome:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    request_id: str | None = None  # the server's id (X-Request-Id), for --hops
    sent_unix: float = 0.0  # wall clock at send, to line up with the server's *_ms stamps
    output_ids: list[int] = field(default_factory=list)  # /generate_stream's token ids (a multi-turn history)

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def mtpot(self) -> float:
        return max(self.itl, default=0.0)


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        slos[key] = float(value) / 1000
    return slos


def _meets(o: Outcome, slos: dict[str, float]) -> bool:
    measured = {"ttft": o.ttft, "tpot": o.tpot, "e2el": o.latency, "mtpot": o.mtpot}
    return all(measured[key] <= limit for key, limit in slos.items() if key != "mtpot")


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    arr = np.array(values or [0.0]) * 1000
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    out.update({f"p{p:g}": float(np.percentile(arr, p)) for p in percentiles})
    return out


def calculate(outcomes: list[Outcome], duration: float, slos: dict[str, float], percentiles: list[float]) -> dict:
    done = [o for o in outcomes if o.success]
    out_tokens = sum(o.output_tokens for o in done)
    in_tokens = sum(o.prompt_len for o in done)
    result = {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "concurrency": sum(o.latency for o in done) / duration,
        "ttft_ms": _stats([o.ttft for o in done], percentiles),
        "tpot_ms": _stats([o.tpot for o in done if o.output_tokens > 1], percentiles),
        "itl_ms": _stats([gap for o in done for gap in o.itl], percentiles),
        "mtpot_ms": _stats([o.mtpot for o in done if o.output_tokens > 1], percentiles),  # a request's longest gap
        "e2el_ms": _stats([o.latency for o in done], percentiles),
    }
    if slos:
        result["goodput_req_s"] = sum(_meets(o, slos) for o in done) / duration
    if "ttft" in slos and "mtpot" in slos:
        good = [o for o in done if o.ttft <= slos["ttft"] and o.mtpot <= slos["mtpot"]]
        result["goodput_pf_tok_s"] = sum(o.prompt_len + o.output_tokens for o in good) / duration
    return result


def report(result: dict, slos: dict[str, float]) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    row = lambda name, value, fmt="{:<44} {:>15}": lines.append(fmt.format(name, value))  # noqa: E731
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Benchmark duration (s):", f"{result['duration_s']:.2f}")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", f"{result['request_throughput']:.2f}")
    if "goodput_req_s" in result:
        slo_text = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in slos.items() if k != "mtpot")
        row(f"Request goodput (req/s) [{slo_text}]:", f"{result['goodput_req_s']:.2f}")
    if "goodput_pf_tok_s" in result:
        row("Goodput, Past-Future (tok/s) [ttft, mtpot]:", f"{result['goodput_pf_tok_s']:.1f}")
    row("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")
    row("Concurrency (sum E2E / duration):", f"{result['concurrency']:.2f}")
    titles = {
        "ttft_ms": ("Time to First Token", "TTFT"),
        "tpot_ms": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl_ms": ("Inter-token Latency", "ITL"),
        "e2el_ms": ("End-to-end Latency", "E2EL"),
    }
    for key, (title, short) in titles.items():
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat, value in result[key].items():
            if stat != "std":
                row(
                    f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {short} (ms):", f"{value:.2f}"
                )
    lines.append("=" * 60)
    return "\n".join(lines)

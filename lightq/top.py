"""``lightq top``: the queue and every worker, live in the terminal (``--once``: one snapshot).

It reads Redis directly (``producer.monitoring.cluster``, the numbers the producer's
``/metrics`` reports): queue depth (lag + pending) and its tokens, the
backlog in GPU-seconds, the drain and arrival rates and the generation
throughput over the last minute, and per worker its KV pool use as a bar,
running and waiting requests and inbox depth.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import unicodedata
from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from lightq.serve_redis import default_data_dir, find_serve_url
from producer.monitoring.cluster import ClusterSnapshot, read_cluster
from producer.monitoring.recent import RequestTracker
from shared.config import RedisSettings
from shared.flags import add_flags, build
from shared.redis import async_client

BAR_WIDTH = 24
SPARK = " ▁▂▃▄▅▆▇█"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", default=None, help="print one snapshot and exit")
    parser.add_argument("--interval", type=float, default=None, help="seconds between refreshes (default 1)")
    add_flags(parser, RedisSettings)


def bar(ratio: float, width: int = BAR_WIDTH) -> Text:
    filled = round(max(0.0, min(1.0, ratio)) * width)
    color = "green" if ratio < 0.7 else "yellow" if ratio < 0.9 else "red"
    return Text("█" * filled, style=color) + Text("░" * (width - filled), style="dim")


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARK[round(v / top * (len(SPARK) - 1))] for v in values)


def summary(snap: ClusterSnapshot, depths: list[float]) -> Text:
    q = snap.ingress
    lines = [
        f"queue  [bold]{q.total}[/] requests (lag {q.lag}, pending {q.pending}) · [bold]{snap.queue_tokens}[/] tokens "
        f"(prompt {snap.queue_prompt_tokens} + predicted output {snap.queue_output_tokens}) · "
        f"backlog [bold]{snap.backlog_gpu_seconds:.1f}[/] GPU-s · dead letters {snap.dead_letters}",
        f"rates  drain [bold]{snap.drain_rate:.2f}[/] req/s · arrivals {snap.arrival_rate:.2f} req/s · "
        f"generation [bold]{snap.generation_tokens_per_s:.1f}[/] tok/s · throughput "
        f"{snap.throughput_tokens_per_s:.1f} tok/s (last {snap.window_s:.0f} s)",
    ]
    if len(depths) > 1:
        lines.append(f"depth  {sparkline(depths)}  (max {max(depths):.0f})")
    lines += shares(snap)
    return Text.from_markup("\n".join(lines))


def printable(name: str) -> str:
    """A name a client chose, its control and format characters shown as '?': rich escapes its
    markup, not a terminal's escape sequences (the producer refuses them; older records may hold them)."""
    return "".join("?" if unicodedata.category(c) in ("Cc", "Cf") else c for c in name)


def shares(snap: ClusterSnapshot, most: int = 6) -> list[str]:
    """The priority order's state (router.order.ordering): queued per class, and the tenants that were
    served the most tokens, with what each has queued (none of it when nothing was ever ordered)."""
    if not snap.tenant_queued and not snap.tenant_served:
        return []
    per_class: dict[int, int] = {}
    for (priority, _), n in snap.tenant_queued.items():
        per_class[priority] = per_class.get(priority, 0) + n
    classes = " · ".join(f"{p}: [bold]{n}[/]" for p, n in sorted(per_class.items())) or "none"
    top = sorted(set(snap.tenant_queued) | set(snap.tenant_served), key=lambda k: -snap.tenant_served.get(k, 0))
    tenants = " · ".join(
        f"{escape(printable(t))} (class {p}) {snap.tenant_queued.get((p, t), 0)} queued, "
        f"{snap.tenant_served.get((p, t), 0)} tok"
        for p, t in top[:most]
    )
    return [f"classes queued per priority {classes}", f"tenants {tenants}"]


def workers_table(snap: ClusterSnapshot) -> Table:
    table = Table(title=f"{len(snap.loads)} live worker(s)", title_justify="left", expand=False)
    for name, justify in (
        ("worker", "left"),
        ("KV usage", "left"),
        ("used / pool", "right"),
        ("cached", "right"),
        ("running", "right"),
        ("waiting", "right"),
        ("inbox", "right"),
        ("preempted", "right"),
    ):
        table.add_column(name, justify=justify)
    for w in snap.worker_summary():
        label = w["worker"] + (" (draining)" if w["draining"] else "")
        table.add_row(
            label,
            bar(w["kv_usage"]) + Text(f" {100 * w['kv_usage']:5.1f}%"),
            f"{w['used_tokens']} / {w['max_total_tokens']}",
            str(w["cached_tokens"]),
            str(w["running"]),
            str(w["waiting"]),
            str(w["inbox"]),
            str(w["preempted_requests"]),  # paused for a better class (router --preempt), since it started
        )
    return table


def render(snap: ClusterSnapshot, depths: list[float] | None = None) -> Group:
    stamp = time.strftime("%H:%M:%S", time.localtime(snap.ts_ms / 1000))
    return Group(Text(f"lightq top  {stamp}", style="bold"), summary(snap, depths or []), workers_table(snap))


async def _loop(settings: RedisSettings, once: bool, interval: float, console: Console) -> None:
    redis, keys = async_client(settings), settings.keys
    try:
        if once:
            console.print(render(await read_cluster(redis, keys)))
            return
        depths: deque[float] = deque(maxlen=60)
        tracker = RequestTracker()
        with Live(console=console, auto_refresh=False) as live:
            while True:
                snap = await read_cluster(redis, keys, tracker)
                depths.append(snap.ingress.total)
                live.update(render(snap, list(depths)), refresh=True)
                await asyncio.sleep(interval)
    finally:
        await redis.aclose()


def run(flags: dict[str, Any], console: Console | None = None) -> int:
    once = bool(flags.pop("once", False))
    interval = flags.pop("interval", None) or 1.0
    if interval < 0:  # it would refresh without a pause, as fast as Redis answers
        raise SystemExit(f"lightq top: --interval {interval:g}: seconds, above 0")
    url = find_serve_url(flags)  # no URL given: a running lightq serve's own Redis, if one runs
    if url is not None:
        flags["redis_url"] = url
    settings = build(RedisSettings, flags)
    if url is None:  # say which Redis it reads: a serve started with another cache folder is not found
        print(
            f"lightq top: no running lightq serve found under {os.path.dirname(default_data_dir(0))}; "
            f"reading {settings.url} (pass --redis_url, as serve's ready line prints it)",
            file=sys.stderr,
        )
    console = console or Console(width=None if not once else max(Console().width, 120))
    try:
        asyncio.run(_loop(settings, once, interval, console))
    except KeyboardInterrupt:
        pass
    return 0

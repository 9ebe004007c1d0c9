"""Serving benchmark against a running lightq (LightLLM's benchmark_sharegpt.py, done fully).

    .venv/bin/python -m bench.serving.serve_bench --base-url http://127.0.0.1:8000 \\
        --num-prompts 200 --request-rate 16 --goodput ttft:50 tpot:12

Workload: a ShareGPT JSON file (``--dataset PATH``), sampled and filtered as
vLLM's ``sample_sharegpt_requests`` does (first human turn -> prompt, the
reply's token count -> output length; prompt and output >= 4 tokens,
prompt <= 1024, prompt + output <= 2048), or without one the synthetic
ShareGPT-like lengths of ``bench/workloads/sharegpt.py`` with random token-id prompts
(``ignore_eos``, so each request emits exactly its drawn length), or one of
the repeating workloads of ``bench/workloads/prefix_workloads.py``: ``--dataset gsp``
(SGLang's generated shared prefix) or ``--dataset multiturn`` (chats that
resend their history; ``--request-rate`` then starts conversations). Requests
go through ``/generate_stream`` (LightLLM's SSE) or, with ``--endpoint
completions``, OpenAI's streaming ``/v1/completions``; arrivals are Poisson
at ``--request-rate`` (``inf``: all at once), at most ``--concurrency`` in
flight. One warm-up request goes first. The numbers follow vLLM's
definitions (``bench/serving/serve_metrics.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor

import httpx
import numpy as np

from bench.serving.serve_metrics import Outcome, calculate, parse_slos, report
from bench.workloads.prefix_workloads import Conversation, Request, conversations, gsp_requests
from bench.workloads.sharegpt import describe, sharegpt_lengths


def synthetic_requests(n: int, seed: int, vocab: int, output_len: int | None) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, size=i).tolist(), i, output_len or o) for i, o in sharegpt_lengths(n, seed)]


def sharegpt_requests(path: str, n: int, seed: int, tokenizer, output_len: int | None) -> list[Request]:
    with open(path) as f:
        conversations = [c["conversations"] for c in json.load(f) if len(c.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(conversations)
    picked: list[Request] = []
    for turns in conversations:
        if len(picked) == n:
            break
        prompt, completion = turns[0]["value"], turns[1]["value"]
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len or len(tokenizer.encode(completion))
        if prompt_len < 4 or out_len < 4 or prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        picked.append((prompt, prompt_len, out_len))
    return picked


def payload(endpoint: str, prompt: str | list[int], out_len: int, ignore_eos: bool) -> tuple[str, dict]:
    if endpoint == "completions":
        return "/v1/completions", {
            "model": "default",
            "prompt": prompt,
            "max_tokens": out_len,
            "stream": True,
            "temperature": 0,
            "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True},
        }
    return "/generate_stream", {"inputs": prompt, "parameters": {"max_new_tokens": out_len, "ignore_eos": ignore_eos}}


def tokens_in(endpoint: str, event: dict) -> tuple[int, int | None]:
    """(chunks carrying text or a token, server-reported output count if this event has one)."""
    if endpoint == "completions":
        usage = event.get("usage") or {}
        return int(bool(event.get("choices"))), usage.get("completion_tokens")
    token = event.get("token") or {}
    return int(token.get("id") is not None), token.get("count_output_tokens") if event.get("finished") else None


async def send(client: httpx.AsyncClient, endpoint: str, req: Request, ignore_eos: bool) -> Outcome:
    prompt, prompt_len, out_len = req
    path, body = payload(endpoint, prompt, out_len, ignore_eos)
    outcome, chunks, reported, last = Outcome(prompt_len=prompt_len), 0, None, None
    start, outcome.sent_unix = time.perf_counter(), time.time()
    try:
        async with client.stream("POST", path, json=body) as response:
            outcome.request_id = response.headers.get("x-request-id")
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return outcome
            async for line in response.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                event = json.loads(data)
                count, server_count = tokens_in(endpoint, event)
                if count and endpoint == "generate_stream":
                    outcome.output_ids.append(event["token"]["id"])
                now = time.perf_counter()
                if count:
                    if chunks == 0:
                        outcome.ttft = now - start
                    else:
                        outcome.itl.append(now - last)
                    chunks, last = chunks + 1, now
                reported = server_count if server_count is not None else reported
        outcome.latency = (last or time.perf_counter()) - start
        outcome.output_tokens = reported if reported is not None else chunks
        outcome.success = chunks > 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome.error = repr(exc)
    return outcome


async def run(args, requests: list[Request], start_at: float | None = None) -> tuple[list[Outcome], float]:
    """Send ``requests`` (a warm-up first, unless ``start_at``: then wait for that wall time)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(None), limits=limits) as client:
        if start_at is None:
            warm = await send(
                client, args.endpoint, (requests[0][0], requests[0][1], min(8, requests[0][2])), args.ignore_eos
            )
            if not warm.success:
                raise SystemExit(f"warm-up request failed: {warm.error}")
        else:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        gate = asyncio.Semaphore(args.concurrency or len(requests))
        rng = np.random.default_rng(args.seed)

        async def one(req: Request) -> Outcome:
            async with gate:
                return await send(client, args.endpoint, req, args.ignore_eos)

        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


async def run_conversations(args, chats: list[Conversation]) -> tuple[list[Outcome], float]:
    """Each conversation's turns one after another (a turn's prompt is the history so far, its
    reply's real ids included), conversations started at ``--request-rate``; a warm-up first."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(None), limits=limits) as client:
        warm_prompt = [3] * 16
        if not (await send(client, args.endpoint, (warm_prompt, 16, 8), args.ignore_eos)).success:
            raise SystemExit("warm-up request failed")
        rng = np.random.default_rng(args.seed)
        rate = args.request_rate
        starts = np.cumsum(rng.exponential(1.0 / rate, len(chats))) if rate != float("inf") else [0.0] * len(chats)

        async def chat(index: int, conv: Conversation, delay: float) -> list[Outcome]:
            await asyncio.sleep(delay)
            outcomes, think = [], np.random.default_rng([args.seed, index])
            for turn in range(len(conv.user_turns)):
                if turn and args.think_s > 0:  # the user reads the reply and types the next message
                    await asyncio.sleep(think.exponential(args.think_s))
                prompt = conv.next_prompt()
                outcome = await send(client, args.endpoint, (prompt, len(prompt), conv.output_len), args.ignore_eos)
                outcomes.append(outcome)
                if not outcome.success:
                    break
                conv.finish_turn(prompt, outcome.output_ids)
            return outcomes

        start = time.perf_counter()
        parts = await asyncio.gather(
            *(chat(i, c, float(d)) for i, (c, d) in enumerate(zip(chats, starts, strict=True)))
        )
        return [o for part in parts for o in part], time.perf_counter() - start


def run_clients(args, requests: list[Request]) -> tuple[list[Outcome], float]:
    """``--clients N``: the requests dealt round-robin to N processes, each with its own event
    loop (and ``--request-rate`` / N: Poisson arrivals split N ways are Poisson), all starting
    at one wall time. One Python client reading a thousand streams falls behind the server
    (~8,000 events/s) and then reads several events per wake-up, which shows as clumped ITL."""
    if args.clients <= 1:
        return asyncio.run(run(args, requests))
    asyncio.run(run(args, requests[:1]))  # the warm-up, once
    share = argparse.Namespace(**{**vars(args), "request_rate": args.request_rate / args.clients})
    start_at = time.time() + 2.0  # every process started and connected by then
    with ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("fork")) as pool:
        parts = list(pool.map(_client, [(share, requests[i :: args.clients], start_at) for i in range(args.clients)]))
    outcomes = [o for part, _ in parts for o in part]
    return outcomes, max(end for _, end in parts) - start_at


def _client(job: tuple) -> tuple[list[Outcome], float]:
    share, requests, start_at = job
    outcomes, _ = asyncio.run(run(share, requests, start_at))
    return outcomes, time.time()


HOPS = [  # (name, from, to): the server's stamps (GET /v1/requests/{id}); "sent"/"first" are the client's
    ("producer: send -> enqueued", "sent", "created_ms"),
    ("router: enqueued -> dispatched", "created_ms", "dispatched_ms"),
    ("inbox: dispatched -> taken", "dispatched_ms", "taken_ms"),
    ("worker: taken -> admitted", "taken_ms", "stepped_ms"),
    ("publisher: admitted -> started", "stepped_ms", "started_ms"),
    ("prefill, write, delivery: started -> client", "started_ms", "first"),
]


async def fetch_stamps(base_url: str, outcomes: list[Outcome]) -> list[dict]:
    """Each successful request's stamps (Unix ms), the client's beside the server's."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:

        async def one(o: Outcome) -> dict | None:
            response = await client.get(f"/v1/requests/{o.request_id}")
            if response.status_code != 200:
                return None
            return {**response.json(), "sent": o.sent_unix * 1000, "first": (o.sent_unix + o.ttft) * 1000}

        found = await asyncio.gather(*(one(o) for o in outcomes if o.success and o.request_id))
    return [f for f in found if f is not None]


def hop_table(stamps: list[dict]) -> str:
    """Median and p90 of each hop of time-to-first-token (a request admitted in a step that did
    not finish its prefill has its first token later than its step end: the publisher hop and
    delivery then include the rest of its prefill)."""
    lines = [f"time to first token by hop, {len(stamps)} requests:", f"{'hop':<34} {'median ms':>10} {'p90 ms':>8}"]
    for name, start, end in HOPS:
        gaps = [s[end] - s[start] for s in stamps if s.get(start) is not None and s.get(end) is not None]
        if gaps:
            lines.append(f"{name:<34} {np.median(gaps):>10.1f} {np.percentile(gaps, 90):>8.1f}")
    total = [s["first"] - s["sent"] for s in stamps]
    if total:
        lines.append(f"{'TTFT (client)':<34} {np.median(total):>10.1f} {np.percentile(total, 90):>8.1f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["generate_stream", "completions"], default="generate_stream")
    p.add_argument(
        "--dataset",
        help="a ShareGPT JSON (ShareGPT_V3_unfiltered_cleaned_split.json), 'gsp' or 'multiturn' "
        "(bench/workloads/prefix_workloads.py); default: synthetic ShareGPT-like lengths",
    )
    p.add_argument("--gsp", default="64,16,2048,128,256", help="gsp: groups,prompts per group,system,question,output")
    p.add_argument("--multiturn", default="32,4,512,128,128", help="multiturn: chats,turns,system,user,output")
    p.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="multiturn: mean seconds (exponential) between a reply and the next turn, as a user reads and types; "
        "without it a turn follows at once, and its worker is the one the previous turn just left",
    )
    p.add_argument("--tokenizer", default="default", help="--model_dir whose tokenizer measures dataset prompts")
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids of synthetic prompts are below this")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="every request's output length")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: on for the synthetic workload, off for a dataset",
    )
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft, tpot, e2el (vLLM), mtpot (Past-Future)")
    p.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--hops", action="store_true", help="also break TTFT down by hop (the status hashes, after the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=1, help="client processes the requests are dealt to")
    p.add_argument("--result-json", help="also write the numbers here")
    args = p.parse_args(argv)
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset in (None, "gsp", "multiturn")
    if args.dataset == "multiturn" and (args.endpoint != "generate_stream" or args.clients != 1):
        p.error("--dataset multiturn reads replies' token ids: --endpoint generate_stream, --clients 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    slos = parse_slos(args.goodput)
    if args.dataset == "multiturn":
        chats = conversations(args.seed, args.vocab_size, *(int(x) for x in args.multiturn.split(",")))
        prompts = [len(c.history) + len(c.user_turns[0]) for c in chats]
        print(f"{len(chats)} conversations x {len(chats[0].user_turns)} turns; first prompts {describe(prompts)}")
        outcomes, duration = asyncio.run(run_conversations(args, chats))
        return finish(args, slos, outcomes, duration)
    if args.dataset == "gsp":
        requests = gsp_requests(args.seed, args.vocab_size, *(int(x) for x in args.gsp.split(",")))
    elif args.dataset:
        from shared.model_files import load_tokenizer, resolve

        tokenizer = load_tokenizer(resolve(args.tokenizer))
        requests = sharegpt_requests(args.dataset, args.num_prompts, args.seed, tokenizer, args.sharegpt_output_len)
    else:
        requests = synthetic_requests(args.num_prompts, args.seed, args.vocab_size, args.sharegpt_output_len)
    print(
        f"{len(requests)} requests; input {describe([r[1] for r in requests])}; "
        f"output {describe([r[2] for r in requests])}; rate {args.request_rate}/s, concurrency {args.concurrency}"
    )
    outcomes, duration = run_clients(args, requests)
    return finish(args, slos, outcomes, duration)


def finish(args, slos, outcomes: list[Outcome], duration: float) -> dict:
    result = calculate(outcomes, duration, slos, [float(p) for p in args.percentiles.split(",")])
    print(report(result, slos))
    if args.hops:
        print(hop_table(asyncio.run(fetch_stamps(args.base_url, outcomes))))
    errors = [o.error for o in outcomes if not o.success]
    if errors:
        print(f"first error: {errors[0]}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()

"""How long a slow grammar compile stalls the other requests of a worker (CPU).

    .venv/bin/python -m bench.serving.grammar_stall                  # this tree
    .venv/bin/python -m bench.serving.grammar_stall --peer 469c2e1   # and an older commit first, in the same run
    .venv/bin/python -m bench.serving.grammar_stall --measure plain  # only the plain requests' latency (below)

One worker in this process: the real service loop (``WorkerService._serve_once``), engine and
runner, the counting model at SmolLM2's vocabulary (the grammar needs the tokenizer's token texts;
a forward costs next to nothing, so a step is the loop's own work), a local Redis under a
throw-away prefix, and the publisher replaced by a recorder that stamps the time each step's tokens
leave the loop. An unconstrained stream decodes; then a request with a JSON schema whose compile
takes about half a second here (counted repetitions in string patterns) arrives. The line gives
the compile's time alone, and the stream's longest and median gap between two of its tokens before
that request arrived and from its arrival to its first token (the hold). Before grammars compiled
off the loop (469c2e1 and older) the hold's longest gap was the compile; after, a step's time.

The second line (``plain``) is issue 33 item 9's figure: plain requests' latency while slow
compiles run. One worker in this process on the embedded SmolLM2 (a real CPU forward, so the model
and the compiles compete for the cores, as they do on a CPU pool), the real service loop; plain
requests (a short prompt, ``PLAIN_TOKENS`` tokens) one after another, first with nothing else to
do, then after ``SLOW`` schemas that each take seconds to compile arrived (``SLOW_PROPERTIES``
counted patterns, each new to every cache, with a compile timeout longer than the run); then the
slow requests are cancelled and their compiles end (or, in a tree that can, are stopped), and the
two phases run again, ``CYCLES`` times, so a change in the machine's other load hits both. The
line gives each phase's median and 90th-percentile latency, their ratios, and how many slow
requests still waited for their grammar at the end of every loaded phase (at least 1: the compiles
ran through it).

With ``--peer COMMIT`` the same run goes first against that commit's tree (``git archive`` into a
temporary folder, with this script and run in this tree's virtual environment). On a 2-core machine the
compile thread and the loop share the cores, so a step is slower while it compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent import futures
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROPERTIES = 2  # counted patterns in the schema: ~0.25 s of compile each on a small CPU
POOL = 65_536  # the stream's tokens (the counting model holds no K/V: only slots are counted)
STREAM_TOKENS = 60_000  # the stream's max_new_tokens: it runs on through the whole measurement
DEADLINE_S = 300.0
PLAIN_REQUESTS = 2  # per phase
CYCLES = 6  # alone then loaded, the load taken away in between: drifts in the machine's other load hit both
PLAIN_TOKENS = 16
SLOW = 4  # schemas compiling while the plain requests run in the second phase
SLOW_PROPERTIES = 30  # each: several seconds of compile alone on a small CPU (a loaded phase: 2-4 s)
PLAIN_DEADLINE_S = 1200.0  # the whole plain run (a tree whose compiles cannot be stopped waits them out)


def schema(nonce: str, properties: int = PROPERTIES) -> dict:
    """A schema that compiles slowly; ``nonce`` makes each one new to every cache."""
    props = {
        f"p{i}_{nonce}": {"type": "string", "pattern": f"[a-z]{{3,{100 + i}}}-[0-9]{{2,{50 + i}}}"}
        for i in range(properties)
    }
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


class Recorder:
    """What the service loop asks of its publisher link: the step's events, stamped."""

    def __init__(self):
        self.stamps: dict[str, list[float]] = {}  # request id -> when each of its tokens left the loop
        self.ids: dict[str, list[int]] = {}
        self.ends: dict[str, float] = {}

    def put(self, events) -> None:
        now = time.perf_counter()
        for event in events:
            # Tokens (one row per sample); by name, not type: the module is the tree's under test
            for request_id, token_id in zip(getattr(event, "request_ids", ()), getattr(event, "token_ids", ())):
                self.stamps.setdefault(request_id, []).append(now)
                self.ids.setdefault(request_id, []).append(token_id)
            if type(event).__name__ == "Released":
                self.ends[event.request_id] = now

    def take_stopped(self) -> list:
        return []

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


def build_worker(redis_url: str, prefix: str):
    """The service on the counting model with SmolLM2's tokenizer; imports from whichever tree runs."""
    import redis
    import torch

    from shared.admission import AdmissionRule
    from shared.config import AdmissionSettings, ModelSettings, RedisSettings
    from shared.keys import WORKER_GROUP
    from shared.model_files import load_tokenizer, resolve
    from shared.redis import ensure_group
    from shared.worker_settings import WorkerSettings
    from worker.engine.engine import Engine, EngineLimits
    from worker.engine.token_pool import TokenPool
    from worker.model.counting_model import CountingModel
    from worker.runner.grammar import Grammars
    from worker.runner.model_runner import ModelRunner
    from worker.runner.req_table import ReqTable
    from worker.service.serve import WorkerService

    try:
        from worker.runner.grammar_cache import GrammarCache
    except ImportError:  # a peer from before grammars compiled off the loop
        from worker.runner.grammar import GrammarCache  # type: ignore[attr-defined,no-redef]

    tokenizer = load_tokenizer(resolve("default"))
    vocab, eos, pool, cpu = len(tokenizer), {2}, POOL, torch.device("cpu")
    grammars = Grammars(GrammarCache.for_tokenizer(tokenizer, vocab, eos))
    runner = ModelRunner(
        CountingModel(vocab, cpu), TokenPool(pool), ReqTable(8, pool, pool, cpu), vocab, cpu, eos, grammars=grammars
    )
    rule = AdmissionRule(AdmissionSettings(admission="conservative"))
    engine = Engine(runner, EngineLimits(pool, 1024, 8), eos, rule)
    settings = WorkerSettings(
        redis=RedisSettings(url=redis_url, key_prefix=prefix), model=ModelSettings(model_dir="counting")
    )
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ensure_group(client, settings.redis.keys.inbox("w"), WORKER_GROUP)
    recorder = Recorder()
    return WorkerService(settings, client, engine, "w", recorder), recorder, client, tokenizer


def dispatch(service, client, request_id: str, max_new: int, spec: str | None = None) -> None:
    from shared.codec import entry
    from shared.schemas import Constraint, GenerateRequest, SamplingParams

    constraint = Constraint(kind="json_schema", spec=spec) if spec is not None else None
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=spec is None, constraint=constraint)
    msg = GenerateRequest(id=request_id, prompt_ids=[504, 3070, 28], params=params, created_ms=0)
    client.xadd(service.keys.inbox("w"), entry(msg))


def compile_alone(tokenizer, spec: str) -> float:
    """The schema's compile on this thread, nothing else running (a fresh compiler, no cache)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    started = time.perf_counter()
    compiler.compile_json_schema(spec, any_whitespace=False)
    return time.perf_counter() - started


def gaps_ms(stamps: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]


def child(redis_url: str, warm_tokens: int) -> dict:
    """One run in the tree on ``sys.path``: the figures as a dict."""
    prefix = f"lightq-bench-{uuid.uuid4().hex[:10]}"
    service, out, client, tokenizer = build_worker(redis_url, prefix)
    try:
        alone = compile_alone(tokenizer, json.dumps(schema(uuid.uuid4().hex[:6])))
        dispatch(service, client, "free", max_new=STREAM_TOKENS)
        deadline = time.perf_counter() + DEADLINE_S
        while len(out.stamps.get("free", [])) < warm_tokens:
            _turn(service, deadline)
        arrived = time.perf_counter()
        dispatch(service, client, "slow", max_new=600, spec=json.dumps(schema(uuid.uuid4().hex[:6])))
        while "slow" not in out.ends:
            _turn(service, deadline)
        assert "free" not in out.ends, "the stream ended before the measurement did: raise STREAM_TOKENS"
        for _ in range(20):  # the stream after it
            service._serve_once()
        first, free = out.stamps["slow"][0], out.stamps["free"]
        earlier = [t for t in free if t <= arrived]
        before = gaps_ms(earlier[-warm_tokens // 2 :])
        # From the stream's last token before the arrival to its first one after the request's first
        # (compiled on the loop, that step's stall is between the two).
        after = [t for t in free if t >= first][:1]
        held = gaps_ms([earlier[-1], *(t for t in free if arrived < t < first), *after])
        text = tokenizer.decode(out.ids["slow"], skip_special_tokens=True)
        return {
            "compile_alone_s": alone,
            "before_max_ms": max(before),
            "before_median_ms": statistics.median(before),
            "hold_s": first - arrived,
            "hold_max_ms": max(held),
            "hold_median_ms": statistics.median(held),
            "hold_tokens": len(held),
            "schema_ok": _follows(text),
        }
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def build_model_worker(redis_url: str, prefix: str, model_dir: str):
    """The service on SmolLM2 (a CPU forward; ``dummy:DIR``: its shape and tokenizer, random weights),
    from whichever tree runs."""
    import redis

    from shared.config import AdmissionSettings, ModelSettings, RedisSettings
    from shared.keys import WORKER_GROUP
    from shared.model_files import load_tokenizer, resolve
    from shared.redis import ensure_group
    from shared.worker_settings import WorkerSettings
    from worker.main import build_engine
    from worker.service.serve import WorkerService

    settings = WorkerSettings(
        redis=RedisSettings(url=redis_url, key_prefix=prefix),
        model=ModelSettings(model_dir=model_dir, max_req_total_len=1024),
        device="cpu",
        max_total_token_num=8192,
        admission_rule=AdmissionSettings(admission="conservative"),
        grammar_compile_timeout_s=PLAIN_DEADLINE_S,  # the slow requests wait through the run: load, not failures
    )
    tokenizer = load_tokenizer(resolve(model_dir))
    engine = build_engine(settings, tokenizer)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ensure_group(client, settings.redis.keys.inbox("w"), WORKER_GROUP)
    recorder = Recorder()
    return WorkerService(settings, client, engine, "w", recorder), recorder, client


def plain_child(redis_url: str, model_dir: str) -> dict:
    """Plain requests' latency alone, then while ``SLOW`` slow schemas compile, in ``CYCLES`` rounds
    (see the module's doc)."""
    prefix = f"lightq-bench-{uuid.uuid4().hex[:10]}"
    service, out, client = build_model_worker(redis_url, prefix, model_dir)
    deadline = time.perf_counter() + PLAIN_DEADLINE_S
    cache = service.grammars.cache

    def plain(request_id: str) -> float:
        started = time.perf_counter()
        dispatch(service, client, request_id, max_new=PLAIN_TOKENS)
        while request_id not in out.ends:
            _turn(service, deadline)
        return out.ends[request_id] - started

    try:
        plain("warm")
        alone, loaded, held, ratios = [], [], [], []
        for cycle in range(CYCLES):
            alone += [plain(f"alone-{cycle}-{i}") for i in range(PLAIN_REQUESTS)]
            slow = [f"slow-{cycle}-{n}" for n in range(SLOW)]
            for request_id in slow:
                spec = json.dumps(schema(uuid.uuid4().hex[:6], SLOW_PROPERTIES))
                dispatch(service, client, request_id, max_new=1, spec=spec)
            loaded += [plain(f"loaded-{cycle}-{i}") for i in range(PLAIN_REQUESTS)]
            held.append(service.grammars.num_held)
            ratios.append(statistics.median(loaded[-PLAIN_REQUESTS:]) / statistics.median(alone[-PLAIN_REQUESTS:]))
            for request_id in slow:  # the load goes: cancelled, and their compiles end (or are stopped)
                client.set(service.keys.cancel(request_id), 1)
            while any(request_id not in out.ends for request_id in slow):
                _turn(service, deadline)
            futures.wait(list(cache._compiling.values()), timeout=max(0.0, deadline - time.perf_counter()))
        return {
            "alone_median_ms": statistics.median(alone) * 1000,
            "alone_p90_ms": _p90(alone) * 1000,
            "loaded_median_ms": statistics.median(loaded) * 1000,
            "loaded_p90_ms": _p90(loaded) * 1000,
            "still_held": min(held),
            "cycle_ratios": ratios,
        }
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def _turn(service, deadline: float) -> None:
    if time.perf_counter() > deadline:
        raise RuntimeError("the run took too long: a request refused or stuck?")
    service._serve_once()


def _follows(text: str) -> bool:
    """Whether the constrained answer parses and each value matches its pattern."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return len(value) == PROPERTIES and all(re.fullmatch(r"[a-z]{3,}-[0-9]{2,}", v) for v in value.values())


def line(name: str, r: dict) -> str:
    return (
        f"{name}: compile alone {r['compile_alone_s']:.2f} s; stream gap before max {r['before_max_ms']:.1f} ms "
        f"(median {r['before_median_ms']:.1f}); while held {r['hold_s']:.2f} s: max {r['hold_max_ms']:.1f} ms "
        f"(median {r['hold_median_ms']:.1f}, {r['hold_tokens']} tokens); answer follows the schema: {r['schema_ok']}"
    )


def plain_line(name: str, r: dict) -> str:
    return (
        f"{name}: plain requests ({PLAIN_TOKENS} tokens, SmolLM2 on the CPU), {CYCLES} x {PLAIN_REQUESTS} each: alone "
        f"median {r['alone_median_ms']:.0f} ms (p90 {r['alone_p90_ms']:.0f}); while {SLOW} slow schemas compile "
        f"median {r['loaded_median_ms']:.0f} ms (p90 {r['loaded_p90_ms']:.0f}): "
        f"{r['loaded_median_ms'] / r['alone_median_ms']:.2f}x median, "
        f"{r['loaded_p90_ms'] / r['alone_p90_ms']:.2f}x p90; "
        f"per cycle (loaded / alone, medians): {' '.join(f'{x:.2f}' for x in r['cycle_ratios'])}, median "
        f"{statistics.median(r['cycle_ratios']):.2f}x; still compiling at the end of each loaded phase: at least "
        f"{r['still_held']} of {SLOW}"
    )


def run_tree(tree: Path, args, measure: str) -> dict:
    """This script as ``tree``'s module in a child process run from ``tree`` (its packages first on the path)."""
    command = [sys.executable, "-m", "bench.serving.grammar_stall", "--child", measure, "--redis-url", args.redis_url]
    command += ["--warm-tokens", str(args.warm_tokens), "--model_dir", args.model_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the run in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peer_tree(commit: str) -> Path:
    """The commit's files in a temporary folder (``git archive``: no worktree is registered)."""
    folder = Path(tempfile.mkdtemp(prefix="lightq-grammar-peer-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    room = folder / "bench" / "serving"  # a commit from before bench/ had rooms lacks the folder
    room.mkdir(parents=True, exist_ok=True)
    (room / "__init__.py").touch()
    shutil.copy(Path(__file__), room / "grammar_stall.py")  # the same measurement
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", help="an older commit to run first, in the same run")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--warm-tokens", type=int, default=200, help="stream tokens before the schema arrives")
    parser.add_argument("--measure", choices=["gap", "plain", "both"], default="both")
    parser.add_argument("--peer-dir", help="an older tree already on disk (instead of --peer: no git needed)")
    parser.add_argument(
        "--model_dir", default="default", help="plain: the model (dummy:DIR for SmolLM2's shape with random weights)"
    )
    parser.add_argument("--child", choices=["gap", "plain"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "gap":
            result = child(args.redis_url, args.warm_tokens)
        else:
            result = plain_child(args.redis_url, args.model_dir)
        print(json.dumps(result))
        return
    measures = ["gap", "plain"] if args.measure == "both" else [args.measure]
    lines = {"gap": line, "plain": plain_line}
    if args.model_dir.startswith("dummy:"):  # the runs' working folders differ
        args.model_dir = "dummy:" + str(Path(args.model_dir[len("dummy:") :]).resolve())
    trees = [(f"peer {args.peer}", peer_tree(args.peer))] if args.peer else []
    if args.peer_dir:
        trees.append((f"peer {args.peer_dir}", Path(args.peer_dir).resolve()))
    try:
        for name, tree in [*trees, ("this tree", REPO)]:
            for measure in measures:
                print(lines[measure](name, run_tree(tree, args, measure)), flush=True)
    finally:
        if args.peer:
            shutil.rmtree(trees[0][1], ignore_errors=True)


if __name__ == "__main__":
    main()

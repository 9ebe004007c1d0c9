"""How long ``lightq serve`` takes to say ``lightq ready``: this tree, and an older commit in the same run.

    .venv/bin/python -m bench.serving.startup                        # --workers 2 on the embedded model, 2 starts
    .venv/bin/python -m bench.serving.startup --peer e0e11c8 --repeat 2
    .venv/bin/python -m bench.serving.startup --serve-args "--model_dir counting --workers 3"

Every start gets a fresh ``--data_dir`` and one ``--weights_cache`` folder for the whole run, filled
by a first start that is not counted (printed as "first"): the starts measured are what a user sees
from the second start on, with the dequantised weights (and, where the tree keeps them, the GGUF's
config and tokenizer) read back. With ``--peer`` the peer's and this tree's starts alternate; the
peer's files come from ``git archive`` into a temporary folder and run on this venv. The line at
the end: the best start of each, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.serving.cpu_bench import stop_serve
from shared.embedded_redis import free_port

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600  # a bound on a start that hangs, not a measurement


def ready_after(tree: Path, cache: str, extra: list[str]) -> float:
    """Seconds from starting ``lightq serve`` in ``tree`` to its ``lightq ready`` line; then stopped."""
    data = Path(tempfile.mkdtemp(prefix="lightq-startup-"))
    log = data / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1", "LIGHTQ_WEIGHTS_CACHE": cache}
    command = [sys.executable, "-m", "lightq.cli", "serve", "--port", str(free_port()), "--data_dir", str(data)]
    start = time.monotonic()
    process = subprocess.Popen([*command, *extra], cwd=tree, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        while "lightq ready" not in log.read_text():
            if process.poll() is not None or time.monotonic() - start > READY_TIMEOUT_S:
                raise RuntimeError(f"lightq serve in {tree} did not get ready:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        return time.monotonic() - start
    finally:
        stop_serve(process)
        shutil.rmtree(data, ignore_errors=True)


def peer_tree(commit: str) -> Path:
    """The commit's files in a temporary folder (``git archive``: no worktree is registered)."""
    folder = Path(tempfile.mkdtemp(prefix="lightq-startup-peer-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", help="an older commit whose starts alternate with this tree's")
    parser.add_argument("--repeat", type=int, default=2, help="starts of each tree measured")
    parser.add_argument("--serve-args", default="--workers 2", help="lightq serve's flags")
    args = parser.parse_args()
    extra = shlex.split(args.serve_args)
    cache = tempfile.mkdtemp(prefix="lightq-startup-cache-")
    trees = {"this tree": REPO}
    if args.peer:
        trees = {f"peer {args.peer}": peer_tree(args.peer), **trees}
    try:
        first = ready_after(REPO, cache, extra)
        print(f"  first start (cache empty): {first:.1f} s", flush=True)
        best: dict[str, float] = {}
        for i in range(args.repeat):
            for name, tree in trees.items():
                seconds = ready_after(tree, cache, extra)
                print(f"  {name}, start {i + 1}: {seconds:.1f} s", flush=True)
                best[name] = min(best.get(name, seconds), seconds)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        for tree in trees.values():
            if tree != REPO:
                shutil.rmtree(tree, ignore_errors=True)
    line = f"startup: lightq serve {args.serve_args} ready after {best['this tree']:.1f} s (first {first:.1f} s)"
    if args.peer:
        peer = best[f"peer {args.peer}"]
        line += f", peer {args.peer} {peer:.1f} s, {peer / best['this tree']:.2f}x faster"
    print(line)


if __name__ == "__main__":
    main()

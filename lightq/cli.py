"""The ``lightq`` command: ``serve`` runs the whole pool on one machine;
``producer``, ``router`` and ``worker`` run one service each (many machines,
one Redis). Every flag is generated from the settings classes."""

from __future__ import annotations

import argparse
import sys

from shared.config import RedisSettings, RouterSettings, RqWorkerSettings, ServeSettings
from shared.flags import add_flags, add_version, build, given
from shared.producer_settings import ProducerSettings
from shared.service import setup_logging
from shared.worker_settings import WorkerSettings

SERVICES = {
    "producer": ProducerSettings,
    "router": RouterSettings,
    "worker": WorkerSettings,
    "rq-worker": RqWorkerSettings,
}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="lightq", description=(__doc__ or "").replace("``", ""))
    add_version(top)
    sub = top.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="producer + router + workers on this machine")
    serve.add_argument("--workers", type=int, default=1, help="number of worker processes (default 1)")
    add_flags(serve, *SERVICES.values(), ServeSettings)
    for name, cls in SERVICES.items():
        add_flags(sub.add_parser(name, help=f"run one {name}"), cls)
    from lightq.top import add_arguments as add_top_arguments

    add_top_arguments(sub.add_parser("top", help="live view of the queue and each worker (--once: one snapshot)"))
    from lightq.batch import add_arguments as add_batch_arguments

    add_batch_arguments(sub.add_parser("batch", help="submit a JSONL batch file and follow it (progress bar)"))
    from lightq.quantize import add_arguments as add_quantize_arguments

    add_quantize_arguments(sub.add_parser("quantize", help="round a model's linear weights to FP8 by GPTQ"))
    dead = sub.add_parser("dead-letters", help="list dead-lettered requests, or requeue them")
    dead.add_argument(
        "action",
        nargs="?",
        default="list",
        choices=["list", "requeue"],
        help="list (the default), or requeue: give entries fresh attempts",
    )
    dead.add_argument("entry_ids", nargs="*", help="dead-letter entry ids to requeue (default: all)")
    add_flags(dead, RedisSettings)
    return top


def check_tp(flags: dict) -> None:
    """``--tp`` above 1 (flag or LIGHTQ_TP): fail now, clearly, not in workers restarted over and over."""
    settings = build(WorkerSettings, flags)
    if settings.tp == 1:
        return
    from worker.main import check_tp as check_worker_tp

    try:
        check_worker_tp(settings)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"lightq: {exc}")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    flags = given(args)
    command = flags.pop("command")
    if command == "top":
        from lightq.top import run as run_top

        sys.exit(run_top(flags))
    if command == "dead-letters":
        from lightq.dead_letters import main as dead_letters

        action, entry_ids = flags.pop("action"), flags.pop("entry_ids", [])
        dead_letters(build(RedisSettings, flags), action, entry_ids)
        return
    if command == "quantize":
        from lightq.quantize import run as run_quantize

        setup_logging()
        sys.exit(run_quantize(flags))
    if command == "batch":
        from lightq.batch import run as run_batch

        sys.exit(run_batch(flags))
    if command == "serve":
        from lightq.checks import check_serve
        from lightq.launcher import serve

        setup_logging()
        workers = flags.pop("workers")
        check_serve(flags, [*SERVICES.values(), ServeSettings], workers)  # before any child starts
        check_tp(flags)
        sys.exit(serve(flags, workers))
    from lightq.checks import build_or_exit
    from shared.service import die_with_serve

    die_with_serve()  # a role lightq serve started ends with it, even when serve is SIGKILLed
    settings = build_or_exit(SERVICES[command], flags)  # a bad setting: one line, not a traceback
    if command == "producer":
        from producer.main import run
    elif command == "router":
        from router.main import run
    elif command == "rq-worker":
        from producer.batches.rq_worker import run
    else:
        from worker.main import run
    run(settings)


if __name__ == "__main__":
    main()

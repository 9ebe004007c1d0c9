"""``lightq batch``: batch jobs from the command line, through the producer's HTTP API.

    lightq batch submit FILE [--wait] [--output OUT]   # prints the batch id; --wait: progress bar, then the output
    lightq batch status BATCH_ID                       # the batch object as JSON
    lightq batch output BATCH_ID [--output OUT]        # the output JSONL (once done)
    lightq batch cancel BATCH_ID

FILE is JSONL in OpenAI's batch format, one request a line:
``{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``.
The producer is ``--url`` (default ``$LIGHTQ_URL`` or http://127.0.0.1:8000).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import httpx
from tqdm import tqdm

DONE = ("completed", "failed", "cancelled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="batch_command", required=True)
    submit = sub.add_parser("submit", help="submit a JSONL batch file")
    submit.add_argument("file", help="JSONL file, one request a line (OpenAI batch format)")
    submit.add_argument("--wait", action="store_true", help="follow it with a progress bar, then print its output")
    for name, what in (
        ("status", "print a batch's progress"),
        ("output", "print a batch's output JSONL"),
        ("cancel", "cancel a batch"),
    ):
        sub.add_parser(name, help=what).add_argument("batch_id")
    for name, command in sub.choices.items():
        command.add_argument(
            "--url",
            default=os.environ.get("LIGHTQ_URL", "http://127.0.0.1:8000"),
            help="the producer (default $LIGHTQ_URL or http://127.0.0.1:8000)",
        )
        if name in ("submit", "output"):
            command.add_argument("--output", help="write the output JSONL here instead of stdout")
        command.add_argument("--poll_s", type=float, default=1.0, help=argparse.SUPPRESS)


def run(flags: dict[str, Any]) -> int:
    """The exit status: 0 when the command (and with --wait, the batch) succeeded."""
    with httpx.Client(base_url=flags["url"], timeout=60) as client:
        try:
            return COMMANDS[flags["batch_command"]](client, flags)
        except ApiFailure as exc:
            print(f"lightq batch: {exc}", file=sys.stderr)
            return 1
        except httpx.HTTPError as exc:
            print(f"lightq batch: cannot reach {flags['url']}: {exc}", file=sys.stderr)
            return 1


class ApiFailure(Exception):
    pass


def _checked(response: httpx.Response, ok: int = 200) -> httpx.Response:
    if response.status_code != ok:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise ApiFailure(f"{response.status_code}: {message}")
    return response


def submit(client: httpx.Client, flags: dict[str, Any]) -> int:
    path = flags["file"]
    if not os.path.isfile(path):  # missing, a folder, or /dev/zero (read for ever)
        raise ApiFailure(f"{path}: not a file")
    with open(path, "rb") as f:
        content = f.read()
    view = _checked(
        client.post("/v1/batches", content=content, headers={"Content-Type": "application/jsonl"}), 202
    ).json()
    print(view["id"], flush=True)
    if not flags.get("wait"):
        return 0
    view = wait(client, view, flags["poll_s"])
    counts = view["request_counts"]
    print(
        f"batch {view['id']} {view['status']}: {counts['completed']} completed, {counts['failed']} failed",
        file=sys.stderr,
    )
    if view["status"] == "failed":  # its answered lines are still written; the rest carry batch_failed
        print(f"lightq batch: {view.get('error')}", file=sys.stderr)
    _write_output(client, view["id"], flags.get("output"))
    return 0 if view["status"] == "completed" else 1


def wait(client: httpx.Client, view: dict, poll_s: float) -> dict:
    """Poll the batch until it ends, with a progress bar of answered requests."""
    counts = view["request_counts"]
    with tqdm(total=counts["total"], unit="req", desc=view["id"][:14], file=sys.stderr) as bar:
        while True:
            counts, live = view["request_counts"], view["status_counts"]
            bar.n = counts["completed"] + counts["failed"]
            bar.set_postfix(  # refreshes the bar with this poll's counts (not the last poll's)
                status=view["status"],
                running=live.get("running", 0),
                queued=live.get("queued", 0),
                failed=counts["failed"],
            )
            if view["status"] in DONE:
                return view
            time.sleep(poll_s)
            view = _checked(client.get(f"/v1/batches/{view['id']}")).json()


def _write_output(client: httpx.Client, batch_id: str, path: str | None) -> None:
    text = _checked(client.get(f"/v1/batches/{batch_id}/output")).text
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def status(client: httpx.Client, flags: dict[str, Any]) -> int:
    print(json.dumps(_checked(client.get(f"/v1/batches/{flags['batch_id']}")).json(), indent=2))
    return 0


def output(client: httpx.Client, flags: dict[str, Any]) -> int:
    _write_output(client, flags["batch_id"], flags.get("output"))
    return 0


def cancel(client: httpx.Client, flags: dict[str, Any]) -> int:
    print(json.dumps(_checked(client.post(f"/v1/batches/{flags['batch_id']}/cancel")).json(), indent=2))
    return 0


COMMANDS = {"submit": submit, "status": status, "output": output, "cancel": cancel}

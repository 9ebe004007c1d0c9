"""``lightq serve``'s life cycle as a user meets it, with real processes, once
it runs (its start: test_serve_startup.py): Ctrl-C (SIGINT to the terminal's
process group) and SIGTERM stop everything quietly without cancelling open
streams' requests, the embedded Redis (its own, append-only, in --data_dir) is
restarted when it dies and stopped last, a SIGKILLed serve takes its pool with
it, a dead worker's record goes at once, and rq's housekeeping survives a Redis
restart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from shared.embedded_redis import free_port, start_embedded_redis
from shared.keys import Keys
from shared.redis import answers

pytestmark = pytest.mark.slow

WAIT_S = 300  # a bound on waiting for something that must happen, not a measurement


def serve_env(data_dir: str) -> dict[str, str]:
    """No Redis URL in the environment: serve must start its own."""
    env = {k: v for k, v in os.environ.items() if k != "LIGHTQ_REDIS_URL"}
    return {**env, "PYTHONUNBUFFERED": "1", "LIGHTQ_DATA_DIR": data_dir}


def wait_for(condition, what: str, timeout_s: float = WAIT_S, what_then=None):
    """``what_then``: what to say of the state when it times out (which processes live, say)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f": {what_then()}" if what_then else ""))


def cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:200]
    except OSError:
        return f"{pid} (gone)"


class Serve:
    """``lightq serve --model_dir counting`` leading its own process group, as a shell runs it."""

    def __init__(self, tmp_path, extra: list[str]):
        self.data_dir = str(tmp_path / "data")
        self.log_path = str(tmp_path / "serve.log")
        self.http = f"http://127.0.0.1:{free_port()}"
        args = [
            sys.executable,
            "-m",
            "lightq.cli",
            "serve",
            "--model_dir",
            "counting",
            "--port",
            self.http.rsplit(":", 1)[1],
            *extra,
        ]
        self.process = subprocess.Popen(
            args,
            env=serve_env(self.data_dir),
            stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(lambda: "lightq ready" in self.log() or self.process.poll() is not None, "lightq ready")
        assert self.process.poll() is None, self.log()[-3000:]
        self.redis_url = re.search(r"embedded Redis at (\S+)", self.log()).group(1)
        self.children = child_pids(self.process.pid)

    def log(self) -> str:
        return open(self.log_path).read()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True)

    def kill(self) -> None:
        for pid in [self.process.pid, *self.children]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def child_pids(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            status = open(f"/proc/{entry}/status").read()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and re.search(rf"^PPid:\s+{pid}$", status, re.M):
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/status").read().find("State:\tZ") < 0
    except OSError:
        return False


def open_stream(http: str, events: list[dict]) -> threading.Thread:
    """A streaming request that stays open (its 300 tokens do not fit the pool of 512 beside the
    running hog's 451 under the conservative rule, so it waits in the queue: one that fits no pool
    at all is refused now), its events collected in a thread."""
    body = {"inputs": "count", "parameters": {"max_new_tokens": 300, "ignore_eos": True}}

    def follow():
        try:
            with httpx.stream("POST", f"{http}/generate_stream", json=body, timeout=120) as response:
                events.append({"id": response.headers["x-request-id"]})
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        events.append(json.loads(line[5:]))
        except httpx.HTTPError:
            pass  # the producer stopping ends the stream; the request must live on

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    return thread


def open_generate(http: str, replies: list[httpx.Response]) -> threading.Thread:
    """A ``/generate`` call that waits in the queue as the stream does; its answer collected."""
    body = {"inputs": "count", "parameters": {"max_new_tokens": 300, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: replies.append(httpx.post(f"{http}/generate", json=body, timeout=120)))
    thread.start()
    return thread


def queued_requests(client) -> int:
    return sum(client.hget(key, "status") == "queued" for key in client.scan_iter(match=Keys("lightq").meta("*")))


def in_append_only_file(data_dir: str, text: bytes) -> bool:
    return any(text in path.read_bytes() for path in Path(data_dir).rglob("*.aof"))


def test_a_serve_killed_by_sigkill_takes_its_pool_with_it(tmp_path):
    """Nothing restarts a child of a dead serve, and they kept its ports: a pool left behind ran on
    unsupervised and a new serve could not start. Every child (its Redis too) ends with it."""
    serve = Serve(tmp_path, [])
    try:
        assert any("redis-server" in open(f"/proc/{pid}/cmdline").read() for pid in serve.children)
        serve.process.send_signal(signal.SIGKILL)
        serve.process.wait(timeout=WAIT_S)
        wait_for(
            lambda: not any(alive(pid) for pid in serve.children),
            "every child gone with serve",
            what_then=lambda: [cmdline(pid) for pid in serve.children if alive(pid)],
        )
    finally:
        serve.kill()
    again = Serve(tmp_path, [])  # the same data directory and Redis files: free again
    again.kill()


def test_a_dead_workers_record_goes_when_serve_sees_it_exit(tmp_path):
    """Routers read a worker whose load record is gone as dead and hand its inbox on; serve deletes
    the record of a worker child it sees exit, so nothing is sent to a dead worker for the rest of
    the record's TTL (red team 7: 1.4 s waits beside an idle worker). Beats a minute apart give the
    records a 3-minute TTL: a record gone within the wait below was deleted, not expired."""
    serve = Serve(tmp_path, ["--workers", "2", "--heartbeat_s", "60"])
    try:
        client = serve.client()
        keys = Keys("lightq")  # serve's default prefix
        workers = client.zrange(keys.workers(), 0, -1)
        assert len(workers) == 2 and all(client.pttl(keys.load(w)) > 120_000 for w in workers)
        victim = workers[0]
        os.kill(int(victim.rsplit("-", 1)[1]), signal.SIGKILL)
        wait_for(lambda: not client.exists(keys.load(victim)), "the dead worker's record deleted", timeout_s=100)
        assert client.exists(keys.load(workers[1]))  # the other one's stays
    finally:
        serve.kill()


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_stop_is_quiet_keeps_open_streams_requests_and_stops_redis_last(tmp_path, how):
    # 200 ms a forward: the hog runs for minutes, holding the pool while the streamed request waits
    args = ["--drain_timeout", "2", "--admission", "conservative", "--max_total_token_num", "512"]
    serve = Serve(tmp_path, [*args, "--counting_step_ms", "200"])
    try:
        assert not serve.redis_url.endswith(":6379/0"), "without a URL, serve runs a Redis of its own"
        serve.client().set("lightq:test-marker", "kept")
        if how == "ctrl-c":  # its embedded Redis dies: serve starts it again, on its port, with its data
            # Serve's Redis fsyncs every second, and while a background fsync runs it may postpone
            # writing the append-only file after a reply; a kill then loses that second (the
            # docs/operations.md says so). What must survive is what reached the file.
            wait_for(lambda: in_append_only_file(serve.data_dir, b"lightq:test-marker"), "the marker on disk")
            redis_pid = next(pid for pid in serve.children if "redis-server" in open(f"/proc/{pid}/cmdline").read())
            os.kill(redis_pid, signal.SIGKILL)
            wait_for(lambda: "the embedded Redis exited" in serve.log() and answers(serve.redis_url), "a new Redis")
            assert serve.client().get("lightq:test-marker") == "kept"
        hog = {"inputs": "count", "parameters": {"max_new_tokens": 450, "ignore_eos": True}}
        hog_id = httpx.post(f"{serve.http}/v1/requests", json=hog, timeout=30).json()["id"]
        wait_for(lambda: serve.client().hget(Keys("lightq").meta(hog_id), "status") == "running", "the hog running")
        events: list[dict] = []
        stream = open_stream(serve.http, events)
        wait_for(lambda: events, "the stream's headers")
        request_id = events[0]["id"]
        assert serve.client().hget(Keys("lightq").meta(request_id), "status") == "queued"
        replies: list[httpx.Response] = []
        call = open_generate(serve.http, replies)
        wait_for(lambda: queued_requests(serve.client()) == 2, "the /generate call queued too")
        before_stop = len(serve.log())
        if how == "ctrl-c":
            os.killpg(serve.process.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
        else:
            serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(timeout=WAIT_S) == 0, serve.log()[-3000:]
        stream.join(timeout=WAIT_S)
        call.join(timeout=WAIT_S)
        # The waiting /generate is told the producer stops and where its answer will be (an empty
        # 499 left it without the id), and its request runs on, as the stream's does.
        [answer] = replies
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "producer_stopping", answer.text
        generate_id = answer.headers["x-request-id"]
        assert f"/v1/requests/{generate_id}" in answer.json()["error"]["message"]
        log = serve.log()[before_stop:]  # (a Redis outage above is noisy, and may be)
        assert "Traceback" not in log and "ERROR" not in log, log[-5000:]
        assert not any(alive(pid) for pid in serve.children), "every child, Redis included, is stopped"
        assert not answers(serve.redis_url)
    finally:
        serve.kill()
    # Redis was stopped last, with everything in its append-only file: start it on the same files.
    restarted = start_embedded_redis(appendonly=True, workdir=serve.data_dir)
    try:
        client = redis.Redis.from_url(restarted.url, decode_responses=True)
        assert client.get("lightq:test-marker") == "kept"
        keys = Keys("lightq")
        for rid in (request_id, generate_id):
            status = client.hget(keys.meta(rid), "status")
            assert status == "queued", status  # never cancelled by the stop: the next serve runs it
            assert not client.exists(keys.cancel(rid))
    finally:
        restarted.stop()


def test_housekeeping_survives_a_redis_restart(tmp_path):
    server = start_embedded_redis(appendonly=True, workdir=str(tmp_path / "redis"))
    prefix = "lightq-test-rq-restart"
    env = {
        **os.environ,
        "LIGHTQ_REDIS_URL": server.url,
        "LIGHTQ_REDIS_KEY_PREFIX": prefix,
        "LIGHTQ_HOUSEKEEPING_INTERVAL_S": "1",
        "LIGHTQ_MODEL_DIR": "counting",
    }
    log_path = tmp_path / "rq.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "lightq.cli", "rq-worker"], env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT
    )
    cursor = Keys(prefix).housekeeping_cursor()  # every housekeeping run writes it
    try:
        client = redis.Redis.from_url(server.url)
        wait_for(lambda: client.exists(cursor), "a first housekeeping run")
        server.process.kill()
        server.process.wait()
        time.sleep(3)  # an outage rq notices (its clients retry a short blip on their own)
        server.restart()
        client = redis.Redis.from_url(server.url)
        client.delete(cursor)
        wait_for(lambda: client.exists(cursor), "housekeeping after the restart")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=WAIT_S) is not None
    finally:
        if worker.poll() is None:
            worker.kill()
        server.stop()


def test_signals_in_a_burst_still_stop_serve(tmp_path):
    """Ctrl-C pressed again and again (SIGINTs a millisecond apart, then SIGTERMs): serve stops, its
    children with it. Its handler once set a threading.Event, whose lock a second signal, landing
    while the first handler held it, asked for again on the same thread: serve hung for good (seen
    with py-spy on a serve given two SIGTERMs). The window is narrow: this burst did not hang the old
    handler when tried here once, so it guards the stop under a burst, not that race itself."""
    serve = Serve(tmp_path, ["--drain_timeout", "1"])
    try:
        for sig in [signal.SIGINT] * 50 + [signal.SIGTERM] * 50:
            serve.process.send_signal(sig)
            time.sleep(0.001)
        serve.process.wait(timeout=WAIT_S)
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in serve.children), "children gone")
    finally:
        serve.kill()

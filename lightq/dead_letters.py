"""``lightq dead-letters``: list the dead-letter stream, or send entries back.

A dead letter is a request whose workers died ``max_attempts`` times (or an
unreadable ingress entry). Requeueing one gives it fresh attempts: its status
goes back to ``queued``, its terminal error chunk is removed (so readers
resume at the same index), and it re-enters the ingress stream with the
tokens it already emitted, continuing where it stopped.
"""

from __future__ import annotations

import redis
from rich.console import Console
from rich.table import Table

from shared import ingress
from shared.chunks import emitted_chunks, parse_run
from shared.codec import from_entry
from shared.config import RedisSettings
from shared.keys import Keys
from shared.redis import sync_client
from shared.requeue import resume_fields
from shared.schemas import DeadLetter, GenerateRequest, RequestMeta, RequestStatus


def read_dead_letter(fields: dict[str, str]) -> DeadLetter:
    """An entry of the stream. One written before dead letters were typed (the request itself
    in the message field, ``reason`` and ``failed_ms`` beside it, or an unreadable entry's
    fields plus ``reason``) still sits in a persistent Redis: it reads into the same model."""
    try:
        return from_entry(DeadLetter, fields)
    except ValueError:
        pass
    rest = {k: v for k, v in fields.items() if k not in ("reason", "failed_ms")}
    try:
        request: GenerateRequest | None = from_entry(GenerateRequest, rest)
    except ValueError:
        request = None
    failed_ms = fields.get("failed_ms", "0")
    return DeadLetter(  # whatever else is in it (a hand-written entry): shown, never a crash of the tool
        reason=fields.get("reason", ""),
        failed_ms=int(failed_ms) if failed_ms.isdigit() else 0,
        request=request,
        raw=None if request is not None else rest,
    )


def list_dead(client: redis.Redis, keys: Keys) -> list[tuple[str, DeadLetter]]:
    return [(entry_id, read_dead_letter(fields)) for entry_id, fields in client.xrange(keys.dead_letters())]


def requeue_dead(client: redis.Redis, keys: Keys, entry_ids: list[str], ttl_s: int) -> int:
    """Requeue the given dead-letter entries (all when empty); returns how many went back."""
    count = 0
    for entry_id, letter in list_dead(client, keys):
        request = letter.request
        if (entry_ids and entry_id not in entry_ids) or request is None:  # an unreadable entry stays
            continue
        # The dead-letter end is a run without tokens, deleted below: these chunks have not ended.
        chunks = [c for c in emitted_chunks(client, keys, request.id) if c.token_id is not None]
        terminal = [i for i, f in client.xrange(keys.chunks(request.id)) if not parse_run(f).token_ids]
        # The data plane first, then the control plane (two slots, shared.keys): a crash between
        # the two leaves the letter in place, and running it again finds no terminal run.
        data = client.pipeline(transaction=True)
        if terminal:
            data.xdel(keys.chunks(request.id), *terminal)
        for key in keys.data_request_keys(request.id):
            data.expire(key, ttl_s)
        data.execute()
        pipe = client.pipeline(transaction=True)
        # An operator's requeue is the one way back from an end; the new epoch fences out anything
        # of the attempts before it (shared.request_log).
        pipe.hincrby(keys.meta(request.id), "epoch", 1)
        pipe.hdel(keys.meta(request.id), "error", "finish_reason", "finished_ms", "worker")
        pipe.hset(keys.meta(request.id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, attempt=0))
        for key in keys.control_request_keys(request.id):
            pipe.expire(key, ttl_s)
        ingress.add(pipe, keys, request.model_copy(update={"attempt": 0, **resume_fields(request, chunks)}))
        pipe.xdel(keys.dead_letters(), entry_id)
        pipe.execute()
        count += 1
    return count


def main(settings: RedisSettings, action: str, entry_ids: list[str]) -> None:
    client = sync_client(settings)
    keys = settings.keys
    console = Console()
    if action == "requeue":
        console.print(f"requeued {requeue_dead(client, keys, entry_ids, settings.request_ttl_s)} dead letter(s)")
        return
    table = Table("entry", "request", "attempts", "prompt tokens", "reason")
    for entry_id, letter in list_dead(client, keys):
        request = letter.request
        table.add_row(
            entry_id,
            request.id if request else "-",
            str(request.attempt + 1) if request else "-",
            str(len(request.prompt_ids)) if request else "-",
            letter.reason,
        )
    console.print(table)

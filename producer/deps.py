"""What a route needs, as ``Annotated`` dependencies (the template's deps.py)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import redis.asyncio as aioredis
from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from producer.api.api_types import GenerateBody
from producer.api.errors import bad_request, from_validation, not_found
from producer.api.vocabulary import Vocabulary
from producer.edge.backlog import Gate
from producer.monitoring.metrics import ProducerMetrics
from producer.streams.stream_hub import StreamHub
from shared.config import RedisSettings
from shared.keys import Keys
from shared.producer_settings import ProducerSettings
from shared.redis import async_client

Body = TypeVar("Body", bound=BaseModel)
REQUEST_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex; anything else cannot exist


@dataclass(frozen=True)
class Services:
    """Everything the lifespan opens, shared by all requests of one app."""

    settings: ProducerSettings
    keys: Keys
    redis: aioredis.Redis
    tokenizer: Any
    metrics: ProducerMetrics
    model_id: str = "default"  # the served model's name on the OpenAI routes
    gate: Gate | None = None  # overload checks before enqueue (None: no limits, e.g. outside the app)
    api_key_hashes: frozenset[str] = frozenset()  # producer.edge.auth; empty: no keys needed
    key_tenants: Mapping[str, str] = field(default_factory=dict)  # key hash -> tenant (producer.edge.auth)
    hub: StreamHub | None = None  # one XREAD for every followed chunk stream (None: a read per follower)
    # Batch records and rq's queue (RedisSettings.batch_url): ``redis`` itself on one server, a client
    # of --redis_rq_url's on a cluster, None on a cluster without one (batches answer 501).
    batch_redis: aioredis.Redis | None = None
    # The tokenizer's ids as logprobs show them (text and raw bytes), made from ``tokenizer``.
    vocabulary: Vocabulary = field(init=False)
    # Prompt text longer than this cannot fit the context (twice the tokens' longest text a token):
    # refused before it is tokenised (a 2 MB prompt took 1.5 s of a core to be told it is too long).
    max_prompt_chars: int | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "vocabulary", Vocabulary(self.tokenizer))
        longest = self.vocabulary.longest_token_chars()
        chars = None if longest is None else 2 * longest * self.settings.model.max_req_total_len
        object.__setattr__(self, "max_prompt_chars", chars)
        if self.batch_redis is None and self.settings.redis.batch_url == self.settings.redis.url:
            object.__setattr__(self, "batch_redis", self.redis)


def batch_client(settings: RedisSettings) -> aioredis.Redis | None:
    """A client of ``--redis_rq_url``'s Redis where one is named apart from the pool's (the caller closes it)."""
    if not settings.batch_url or settings.batch_url == settings.url:
        return None
    return async_client(settings.model_copy(update={"url": settings.batch_url, "rq_url": ""}))


def get_services(request: Request) -> Services:
    return request.app.state.services


# A body past this is validated on a thread: a 1.6 MB list of 400,000 prompts took pydantic 3 s
# (every member of the prompt's union tried), and held the producer's other clients meanwhile.
LARGE_BODY_BYTES = 64 * 1024


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body (its Content-Type was checked by producer.edge.front_door: JSON, or 415)."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("request body is empty", code="empty_body", reason="invalid_json")
    try:
        if len(raw) <= LARGE_BODY_BYTES:
            return model.model_validate_json(raw)
        return await asyncio.to_thread(model.model_validate_json, raw)
    except ValidationError as exc:
        raise from_validation(exc.errors(include_url=False)) from None


async def parse_generate_body(request: Request) -> GenerateBody:
    return await parse_body(request, GenerateBody)


def valid_request_id(request_id: str) -> str:
    if not REQUEST_ID.fullmatch(request_id):
        raise not_found(request_id)
    return request_id


ServicesDep = Annotated[Services, Depends(get_services)]
GenerateBodyDep = Annotated[GenerateBody, Depends(parse_generate_body)]
RequestIdDep = Annotated[str, Depends(valid_request_id)]

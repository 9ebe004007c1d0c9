"""Validate, tokenise and enqueue one request; nothing is written on rejection."""

from __future__ import annotations

import asyncio
import math
import secrets
import unicodedata
import uuid
from typing import Any

from producer import store
from producer.api.api_types import GenerateBody
from producer.api.errors import bad_request
from producer.api.lora import find_adapter
from producer.api.params import check_group, check_prompt_length, native_sampling
from producer.api.structured import NATIVE_NAMES, SchemaLimits, check_constraint, check_no_min_tokens
from producer.deps import Services
from producer.edge.backlog import Gate
from shared.request_log import now_ms
from shared.schemas import DEFAULT_TENANT, MAX_TENANT_CHARS, GenerateRequest, SamplingParams


async def prompt_ids(
    inputs: str | list[int], tokenizer: Any, param: str = "inputs", max_chars: int | None = None
) -> list[int]:
    """Token ids of the prompt; text is encoded off the event loop, unless it is longer than
    ``max_chars`` (``Services.max_prompt_chars``: it cannot fit)."""
    if not inputs:
        raise bad_request(f"{param} is empty", param=param, code="empty_input", reason="empty_input")
    if isinstance(inputs, str):
        too_long(len(inputs), max_chars, param)
        ids = list(await asyncio.to_thread(tokenizer.encode, inputs))
        if not ids:
            raise bad_request(f"{param} encodes to no tokens", param=param, code="empty_input", reason="empty_input")
        return ids
    vocab_size = len(tokenizer)
    bad = next((token for token in inputs if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})",
            param=param,
            code="invalid_token_id",
            reason="invalid_token_id",
        )
    return list(inputs)


def too_long(chars: int, max_chars: int | None, param: str) -> None:
    """A 400 for prompt text too long to fit however it tokenises, before anything tokenises it."""
    if max_chars is not None and chars > max_chars:
        raise bad_request(
            f"{param}: {chars} characters cannot fit the model's context (at most {max_chars} could)",
            param=param,
            code="context_length_exceeded",
            reason="too_long",
        )


def check_length(num_prompt_tokens: int, max_new_tokens: int, max_req_total_len: int) -> None:
    total = num_prompt_tokens + max_new_tokens
    if total > max_req_total_len:
        raise bad_request(
            f"prompt has {num_prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
            f"{total} exceeds max_req_total_len {max_req_total_len}",
            param="inputs",
            code="context_length_exceeded",
            reason="too_long",
        )


def new_request(
    ids: list[int],
    params: SamplingParams,
    timeout_s: float | None = None,
    n: int = 1,
    priority: int = 0,
    user: str | None = None,
    adapter: str | None = None,
    adapter_path: str | None = None,
) -> GenerateRequest:
    """A new request; its id (uuid4: 122 random bits) is unguessable, which status URLs rely on.

    ``priority`` and ``user`` (OpenAI's end-user id) are for the router's order: ``user`` is the
    tenant where no API keys are configured (``enqueue`` puts the key's tenant in its place).

    ``timeout_s`` becomes an absolute ``deadline_ms`` the router checks while the request waits.
    ``n`` > 1: a group of samples. A sampled group without a seed gets one, so its samples are
    reproducible (no longer needed for a requeue: each sample continues after the tokens it
    already emitted, see shared.requeue). ``adapter_path``: a run-time adapter's folder, which the
    request carries (``GenerateRequest.brings_adapter``).
    """
    created = now_ms()
    deadline = None if timeout_s is None else created + math.ceil(timeout_s * 1000)
    if n > 1 and params.seed is None and not params.is_greedy:
        params = params.model_copy(update={"seed": secrets.randbits(63)})
    return GenerateRequest(
        id=uuid.uuid4().hex,
        prompt_ids=ids,
        params=params,
        created_ms=created,
        deadline_ms=deadline,
        n=n,
        priority=priority,
        tenant=user_tenant(user),
        adapter=adapter,
        adapter_path=adapter_path,
    )


def user_tenant(user: str | None) -> str:
    """OpenAI's ``user`` as a tenant: blank is the default tenant; 400 if longer than a tenant may be."""
    if user is None or not user.strip():
        return DEFAULT_TENANT
    if len(user) > MAX_TENANT_CHARS:
        raise bad_request(f"user: at most {MAX_TENANT_CHARS} characters, got {len(user)}", param="user")
    # A tenant is shown to operators (lightq top, /metrics, the dashboard): a control or format
    # character (escapes, newlines, bidi overrides) would write into their terminals.
    if any(unicodedata.category(c) in ("Cc", "Cf") for c in user):
        raise bad_request("user: control and format characters are not allowed", param="user")
    return user


async def prepare(body: GenerateBody, services: Services) -> GenerateRequest:
    tokenizer, settings = services.tokenizer, services.settings
    n = check_group(body.params.n, body.params.best_of, "parameters.")
    adapter, folder = await find_adapter(body.params.adapter, services, "parameters.adapter")
    params = native_sampling(body.params, settings.default_max_new_tokens, tokenizer)
    if params.constraint is not None:
        param = f"parameters.{NATIVE_NAMES[params.constraint.kind]}"
        constraint = await check_constraint(params.constraint, param, SchemaLimits.of(settings))
        params = params.model_copy(update={"constraint": constraint})
        check_no_min_tokens(params.constraint, params.min_new_tokens, "parameters.min_new_tokens")
    ids = await prompt_ids(body.inputs, tokenizer, max_chars=services.max_prompt_chars)
    check_prompt_length(len(ids), settings.model.max_req_input_len, "inputs")
    check_length(len(ids), params.max_new_tokens, settings.model.max_req_total_len)
    return new_request(ids, params, body.params.timeout, n, body.params.priority, adapter=adapter, adapter_path=folder)


async def enqueue(
    request: GenerateRequest, route: str, services: Services, key_hash: str | None = None
) -> GenerateRequest:
    """Write the request (status hash + ingress entry) and count it; 429/503 when overloaded.

    ``key_hash`` (``producer.edge.auth``) marks the request as the submitting key's own, and makes
    it its key's tenant's: with keys, a client cannot pick its tenant (``user`` is ignored).
    """
    # Without the app's gate (a caller outside it) the request is still counted in the backlog.
    gate = services.gate or Gate(services.redis, services.keys, max_queue_tokens=0, require_workers=False)
    update: dict[str, Any] = {"model": services.model_id}  # only its model's workers take it
    if services.hub is not None and services.hub.wake_id is not None:
        update["reply_to"] = services.hub.wake_id  # its publisher tells this producer of new chunks
    if key_hash is not None:
        update["tenant"] = services.key_tenants.get(key_hash, DEFAULT_TENANT)
    request = request.model_copy(update=update)
    await gate.enqueue(request, services.settings.redis.request_ttl_s, key_hash)
    services.metrics.accepted.labels(route=route).inc()
    services.metrics.prompt_tokens.inc(request.num_prompt_tokens)
    return request


async def submit(body: GenerateBody, route: str, services: Services, key_hash: str | None = None) -> GenerateRequest:
    """Validate and enqueue; raises ApiError (400) before anything is written."""
    return await enqueue(await prepare(body, services), route, services, key_hash)


async def abandon(services: Services, request_id: str) -> None:
    """The client left before the end: cancel the request wherever it is."""
    await store.request_cancel(services.redis, services.keys, request_id, services.settings.redis.request_ttl_s)
    services.metrics.disconnects.inc()


async def abandon_all(services: Services, request_ids: list[str]) -> None:
    """The client of several requests (a completion's prompts) left: cancel every one."""
    for request_id in request_ids:
        await store.request_cancel(services.redis, services.keys, request_id, services.settings.redis.request_ttl_s)
    services.metrics.disconnects.inc()

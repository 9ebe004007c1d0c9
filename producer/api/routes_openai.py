"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

``/v1/models`` lists this producer's model and every other model a live worker
of the pool serves (from the last cluster view, ``producer.monitoring``): a
producer tokenises for its own model only, so the others are marked
``accepted_here: false`` (a client sends those to a producer started with that
``--served_model_name``).

An application written for the official ``openai`` client works by changing
its base URL. Every check runs before anything is written (as on the native
routes); the answer then follows the request's chunk stream, streamed as SSE
ending with ``data: [DONE]`` or collected into one response with ``usage``.
A client that leaves cancels its request. A completion of several prompts
is one request per prompt, all checked before any is queued, followed
together (``MergedFollower``) and cancelled together.
"""

from __future__ import annotations

import functools
import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from producer import store
from producer.api.api_types import body_doc
from producer.api.chat import chat_prompt_ids, completion_inputs, content_chars, prompt_text
from producer.api.errors import ApiError, bad_request
from producer.api.lora import adapter_names, run_time_folder
from producer.api.openai_render import Call, StreamRenderer, response
from producer.api.openai_types import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from producer.api.params import check_prompt_length
from producer.api.structured import SchemaLimits, check_constraint, check_no_min_tokens
from producer.api.submit import abandon_all, enqueue, new_request, prompt_ids, too_long
from producer.api.tools import output_constraint, plan_tools
from producer.deps import Services, ServicesDep, parse_body
from producer.edge.auth import CallerDep
from producer.edge.pool_fit import PoolFit
from producer.streams.merged_follower import MergedFollower
from producer.streams.responses import EventStream, collect, rendered, unanswered
from producer.streams.streaming import follower
from shared.schemas import GenerateRequest

router = APIRouter(prefix="/v1")
STARTED = int(time.time())
ERRORS = {400: {"description": "invalid parameters (OpenAI error shape)"}, 404: {"description": "unknown model"}}


class PoolModelCard(ModelCard):
    """OpenAI's model object, with what the pool says of it (extra fields, which OpenAI's allow)."""

    max_model_len: int | None = Field(description="max prompt + generated tokens per request; null: not known here")
    accepted_here: bool = Field(description="this producer takes requests for it (it tokenises for its own model)")
    live_workers: int | None = Field(description="live workers serving it; null: the pool not read yet")
    parent: str | None = Field(None, description="a LoRA adapter's base model (vLLM's field); null: a model")


class PoolModelList(ModelList):
    data: list[PoolModelCard]


async def _cards(services: Services) -> list[PoolModelCard]:
    """This producer's model first, its adapters (--lora_modules', then run-time ones), then the
    pool's others by name."""
    snapshot, own = services.metrics.snapshot, services.model_id
    counts = snapshot.workers_by_model(own) if snapshot is not None else {}
    cards = [
        PoolModelCard(
            id=own,
            created=STARTED,
            root=own,
            max_model_len=services.settings.model.max_req_total_len,
            accepted_here=True,
            live_workers=counts.pop(own, 0) if snapshot is not None else None,
        )
    ]
    for adapter in await adapter_names(services):  # served on the same workers
        cards.append(cards[0].model_copy(update={"id": adapter, "root": adapter, "parent": own}))
    for name, workers in sorted(counts.items()):
        cards.append(
            PoolModelCard(
                id=name, created=STARTED, root=name, max_model_len=None, accepted_here=False, live_workers=workers
            )
        )
    return cards


@router.get("/models")
async def list_models(services: ServicesDep) -> PoolModelList:
    return PoolModelList(data=await _cards(services))


@router.get("/models/{model_id:path}", responses={404: ERRORS[404]})
async def get_model(model_id: str, services: ServicesDep) -> PoolModelCard:
    cards = await _cards(services)
    for card in cards:
        if card.id == model_id:
            return card
    await check_model(model_id, services)  # 404, unless it names this producer's --model_dir
    return cards[0]


async def check_model(model: str, services: Services) -> tuple[str | None, str | None]:
    """The served model answers to its id (and to the ``--model_dir`` it was started with); a LoRA
    adapter of it to its name (--lora_modules' or run-time: ``producer.api.lora``), returned with its
    run-time folder ((None, None): the model itself; a --lora_modules adapter has no folder here)."""
    if model in services.settings.model.adapter_names:
        return model, None
    if model not in (services.model_id, services.settings.model.model_dir):
        if (folder := await run_time_folder(model, services)) is not None:
            return model, folder
        snapshot = services.metrics.snapshot
        in_pool = snapshot is not None and model in snapshot.workers_by_model(services.model_id)
        where = f"; '{model}' is served in this pool: send it to a producer of that model" if in_pool else ""
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{services.model_id}'{where}",
            param="model",
            code="model_not_found",
            reason="unknown_model",
        )
    return None, None


def check_context(num_prompt: int, max_new: int, limit: int, where: str) -> None:
    """OpenAI's wording, with both numbers; chat without max_tokens gets what the prompt leaves."""
    if num_prompt + max_new > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + max_new} tokens ({num_prompt} in the {where}, {max_new} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            param=where,
            code="context_length_exceeded",
            reason="too_long",
        )


@router.post("/completions", responses=ERRORS, openapi_extra=body_doc(CompletionRequest))
async def completions(request: Request, services: ServicesDep, caller: CallerDep) -> Response:
    body = await parse_body(request, CompletionRequest)
    queued, call = await prepare_completions(body, services)
    await _enqueue_all(queued, "completions", services, caller.key_hash)
    return await _answer(request, services, queued, call, body.stream)


async def prepare_completions(body: CompletionRequest, services: Services) -> tuple[list[GenerateRequest], Call]:
    """Every check and the tokenisation of a completion, a request per prompt; nothing is written."""
    adapter, folder = await check_model(body.model, services)
    body.check()
    prompts = completion_inputs(body.prompt, services.settings.max_prompts)
    # max_tokens 0 scores the prompt only: one token is generated and left out of the answer.
    max_new = body.max_tokens or (1 if body.max_tokens == 0 else services.settings.default_max_new_tokens)
    requested, param = body.requested_constraint()
    constraint = await check_constraint(requested, param, SchemaLimits.of(services.settings))
    check_no_min_tokens(constraint, body.min_tokens, "min_tokens")
    extra = {"constraint": constraint, "prompt_logprobs": body.prompt_logprobs}
    params = body.sampling(max_new, services.tokenizer).model_copy(update=extra)
    queued: list[GenerateRequest] = []
    for i, inputs in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        ids = await prompt_ids(inputs, services.tokenizer, param=param, max_chars=services.max_prompt_chars)
        check_prompt_length(len(ids), services.settings.model.max_req_input_len, "prompt")
        check_context(len(ids), max_new, services.settings.model.max_req_total_len, "prompt")
        queued.append(
            new_request(ids, params, body.timeout, body.num_choices, body.priority, body.user, adapter, folder)
        )
    echo = tuple(prompt_text(inputs, services.tokenizer) for inputs in prompts) if body.echo else ()
    call = Call(
        "completion",
        f"cmpl-{queued[0].id}",
        int(time.time()),
        body.model,
        sum(q.num_prompt_tokens for q in queued),
        logprobs=body.logprobs is not None,
        include_usage=body.include_usage,
        echo=echo,
        n=body.num_choices,
        num_prompts=len(queued),
        score_only=body.max_tokens == 0,
        prompt_ids=tuple(q.prompt_ids for q in queued) if body.prompt_logprobs is not None else (),
    )
    return queued, call


async def prepare_completion(body: CompletionRequest, services: Services) -> tuple[GenerateRequest, Call]:
    """A batch line's completion: one prompt (its answer is one line of the output file)."""
    queued, call = await prepare_completions(body, services)
    if len(queued) > 1:
        raise bad_request(
            f"prompt: a batch line takes one prompt, got {len(queued)}; give each its own line",
            param="prompt",
            code="too_many_prompts",
        )
    return queued[0], call


async def _enqueue_all(queued: list[GenerateRequest], route: str, services: Services, key_hash: str | None) -> None:
    """Queue each prompt's request; when one is refused (429, 503), cancel those already queued."""
    for count, one in enumerate(queued):
        try:
            await enqueue(one, route, services, key_hash)
        except Exception:
            for earlier in queued[:count]:
                await store.request_cancel(
                    services.redis, services.keys, earlier.id, services.settings.redis.request_ttl_s
                )
            raise


@router.post("/chat/completions", responses=ERRORS, openapi_extra=body_doc(ChatCompletionRequest))
async def chat_completions(request: Request, services: ServicesDep, caller: CallerDep) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    queued, call = await prepare_chat(body, services)
    await enqueue(queued, "chat", services, caller.key_hash)
    return await _answer(request, services, [queued], call, body.stream)


async def prepare_chat(body: ChatCompletionRequest, services: Services) -> tuple[GenerateRequest, Call]:
    """Every check and the chat template of a chat completion; nothing is written (batches share it)."""
    adapter, folder = await check_model(body.model, services)
    body.check()
    legacy = body.functions is not None or body.function_call is not None
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, legacy)
    requested, param = body.requested_constraint()
    constraint = await output_constraint(requested, param, plan, SchemaLimits.of(services.settings))
    check_no_min_tokens(constraint, body.min_tokens, "min_tokens")
    too_long(content_chars(body.messages), services.max_prompt_chars, "messages")
    ids = await chat_prompt_ids(body.messages, services.tokenizer, plan)
    check_prompt_length(len(ids), services.settings.model.max_req_input_len, "messages")
    limit = services.settings.model.max_req_total_len
    # Without a limit the answer may fill the context (LightLLM and vLLM do the same), and n answers
    # share what the largest live pool holds (or the request could fit no worker: pool_fit's 400).
    if not (max_new := body.requested_max_tokens or 0):
        fit = services.gate.fit if services.gate is not None else PoolFit(services.redis, services.keys)
        pool = await fit.largest(services.model_id, adapter)
        room = (pool - len(ids)) // body.num_choices
        max_new = max(min(limit - len(ids), room), 1)
    check_context(len(ids), max_new, limit, "messages")
    if body.logprobs:  # the tokens' raw bytes (vocabulary.py), built off the event loop before a chunk needs them
        await services.vocabulary.prepare()
    params = body.sampling(max_new, services.tokenizer).model_copy(update={"constraint": constraint})
    queued = new_request(ids, params, body.timeout, body.num_choices, body.priority, body.user, adapter, folder)
    call = Call(
        "chat",
        f"chatcmpl-{queued.id}",
        int(time.time()),
        body.model,
        len(ids),
        logprobs=body.logprobs,
        include_usage=body.include_usage,
        n=queued.n,
        tools=plan,
    )
    return queued, call


async def _answer(
    request: Request, services: Services, queued: list[GenerateRequest], call: Call, stream: bool
) -> Response:
    """Follow the requests (one per prompt) to the end; a client that leaves cancels them all."""
    followers = [follower(services, one.id, one.n) for one in queued]
    reader = followers[0] if len(followers) == 1 else MergedFollower(followers)
    on_abandon = functools.partial(abandon_all, services, [one.id for one in queued])
    if stream:
        renderer = StreamRenderer(call, services.vocabulary)
        return EventStream(
            rendered(reader, renderer, request.is_disconnected, on_abandon),
            request_id=queued[0].id if len(queued) == 1 else None,
        )
    chunks = await collect(reader, request.is_disconnected, on_abandon)
    if chunks is None:
        return unanswered([one.id for one in queued])  # the client left (499), or this producer stops (503)
    return JSONResponse(response(call, chunks, services.vocabulary).model_dump(mode="json"))

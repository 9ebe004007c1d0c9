"""The official ``openai`` client against a real uvicorn server, fed by the fake
worker: only the base URL differs from talking to OpenAI."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shared.schemas import RequestStatus

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]


def hello(request):
    return ["Paris", " is", " nice"], "length"


async def test_models_lists_the_served_model(oai):
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 2048
    assert (await oai.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await oai.models.retrieve("gpt-4")


async def test_completion_maps_every_parameter(oai, worker, tokenizer):
    async with worker.answering(hello) as seen:
        out = await oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=7,
            temperature=0.7,
            top_p=0.9,
            stop=["\n", "END"],
            presence_penalty=0.5,
            frequency_penalty=0.25,
            seed=11,
            user="someone",
            extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2},
        )
    (request,) = seen
    params = request.params
    assert request.prompt_ids == tokenizer.encode(PROMPT)
    assert (params.max_new_tokens, params.do_sample, params.temperature, params.top_p) == (7, True, 0.7, 0.9)
    assert params.stop_sequences == ("\n", "END") and params.seed == 11
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, 0.25, 1.1)
    assert (params.top_k, params.min_p, params.ignore_eos, params.min_new_tokens) == (40, 0.05, True, 2)
    assert out.object == "text_completion" and out.model == MODEL and out.id == f"cmpl-{request.id}"
    assert out.choices[0].text == "Paris is nice" and out.choices[0].finish_reason == "length"
    n_prompt = len(request.prompt_ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 3, n_prompt + 3)


async def test_temperature_zero_is_greedy_and_defaults_sample(oai, worker, settings):
    async with worker.answering(hello) as seen:
        await oai.completions.create(model=MODEL, prompt=[1, 2, 3], temperature=0)
        await oai.completions.create(model=MODEL, prompt=[[4, 5]])
    greedy, default = seen
    assert greedy.prompt_ids == [1, 2, 3] and greedy.params.is_greedy and not greedy.params.do_sample
    assert default.prompt_ids == [4, 5] and default.params.do_sample and default.params.temperature == 1.0
    assert default.params.max_new_tokens == settings.default_max_new_tokens


async def test_completion_stream_with_usage_echo_and_logprobs(oai, worker):
    async with worker.answering(hello) as seen:
        stream = await oai.completions.create(
            model=MODEL, prompt=PROMPT, stream=True, echo=True, stream_options={"include_usage": True}
        )
        events = [event async for event in stream]
        stream = await oai.completions.create(model=MODEL, prompt=PROMPT, stream=True, logprobs=0)
        with_logprobs = [event async for event in stream]
    texts = [e.choices[0].text for e in events if e.choices]
    assert texts == [PROMPT, "Paris", " is", " nice"]
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 3
    assert events[-1].usage.prompt_tokens == len(seen[0].prompt_ids)
    assert all(e.usage is None for e in events[:-1])
    logprobs = [e.choices[0].logprobs for e in with_logprobs]
    assert [lp.token_logprobs for lp in logprobs] == [[-0.25]] * 3
    assert [lp.text_offset for lp in logprobs] == [[0], [5], [8]]
    assert all(e.usage is None for e in with_logprobs)


async def test_completion_logprobs_and_echo_not_streamed(oai, worker, tokenizer):
    async with worker.answering(hello):
        out = await oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=0)
        echoed = await oai.completions.create(model=MODEL, prompt=tokenizer.encode(PROMPT), echo=True)
    logprobs = out.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([i]) for i in (100, 101, 102)]
    assert logprobs.token_logprobs == [-0.25] * 3 and logprobs.text_offset == [0, 5, 8]
    assert echoed.choices[0].text == PROMPT + "Paris is nice"


async def test_chat_uses_the_template(oai, worker, tokenizer, settings):
    async with worker.answering(lambda r: (["Paris", "."], "stop")) as seen:
        out = await oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, seed=5, max_completion_tokens=9
        )
        no_limit = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    template = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert seen[0].prompt_ids == list(template) and seen[0].params.max_new_tokens == 9
    assert seen[0].params.seed == 5 and seen[0].params.do_sample
    assert seen[1].params.max_new_tokens == settings.model.max_req_total_len - len(template)
    assert not seen[1].params.do_sample
    assert out.object == "chat.completion" and out.id == f"chatcmpl-{seen[0].id}"
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "Paris."
    assert choice.finish_reason == "stop" and no_limit.choices[0].message.content == "Paris."
    assert [c.logprob for c in choice.logprobs.content] == [-0.25, -0.25]
    assert choice.logprobs.content[0].token == tokenizer.decode([100])
    assert out.usage.prompt_tokens == len(template) and out.usage.completion_tokens == 2


async def test_chat_stream(oai, worker):
    async with worker.answering(lambda r: (["Par", "is", ""], "stop")):
        stream = await oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        events = [event async for event in stream]
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == "Paris"
    finished = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
    assert finished == ["stop"] and all(e.object == "chat.completion.chunk" for e in events)
    assert events[-1].usage.completion_tokens == 3


async def test_errors_are_openai_errors(oai, worker):
    with pytest.raises(openai.NotFoundError) as info:
        await oai.completions.create(model="gpt-4", prompt="hi")
    assert info.value.code == "model_not_found" and "gpt-4" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=9)
    assert info.value.param == "n" and "[1, 8]" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await oai.completions.create(model=MODEL, prompt="lorem ipsum " * 1200, max_tokens=50)
    assert info.value.code == "context_length_exceeded"
    assert "2048" in info.value.message and "50 in the completion" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)
    assert info.value.param == "top_logprobs" and "logprobs" in info.value.message


async def test_a_failed_request(oai, worker):
    async def fail_next():
        request = await worker.take()
        await worker.end(request.id, 0, RequestStatus.FAILED, "error", error="worker died")

    task = asyncio.create_task(fail_next())
    with pytest.raises(openai.InternalServerError) as info:
        await oai.completions.create(model=MODEL, prompt="hi")
    await task
    assert "worker died" in info.value.message


async def test_stream_disconnect_cancels(server_url, worker):
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    async with httpx.AsyncClient(base_url=server_url) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            request = await worker.take()
            await worker.token(request.id, 0, "Hi")
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: {")
        assert await worker.wait_cancel(request.id)

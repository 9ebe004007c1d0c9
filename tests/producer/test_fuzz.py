"""Property-based fuzzing of the producer's OpenAPI schema (schemathesis): valid and
invalid requests to every operation, against the ASGI app and a fake worker that
answers every request, must never get a 5xx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from producer.app import create_app  # noqa: E402
from shared.keys import Keys  # noqa: E402
from shared.redis import async_client  # noqa: E402
from tests.producer.fake_worker import FakeWorker  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the served model's id
EXAMPLES = 25  # per operation and mode: the whole run stays well under a minute
FUZZ_SETTINGS = hypothesis_settings(
    max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


@schemathesis.serializer("application/jsonl")
def _jsonl(ctx, value) -> bytes:
    """Batch files (documented as a string): sent as they are, lone surrogates and all."""
    if isinstance(value, str):
        return value.encode("utf-8", errors="surrogatepass")
    return json.dumps(value).encode()


class WorkerThread(threading.Thread):
    """The fake worker on its own event loop: the app runs on schemathesis' loop thread."""

    def __init__(self, redis_settings) -> None:
        super().__init__(daemon=True)
        self.redis_settings = redis_settings
        self.stop = threading.Event()

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        redis = async_client(self.redis_settings)
        worker = FakeWorker(redis, Keys(self.redis_settings.key_prefix))
        try:
            while not self.stop.is_set():
                with contextlib.suppress(TimeoutError):
                    request = await worker.take(timeout_s=0.2)
                    await worker.generate(request, ["a", "b"], finish_reason="length")
        finally:
            await redis.aclose()


@pytest.fixture
def api_schema(settings, tokenizer, redis_settings):
    worker = WorkerThread(redis_settings)
    worker.start()
    # Limits on, so their code paths are fuzzed too (keys off: every call would be a 401).
    app = create_app(
        settings.model_copy(update={"max_queue_tokens": 1_000_000, "max_body_bytes": 64 * 1024}), tokenizer=tokenizer
    )
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    worker.stop.set()
    worker.join(timeout=5)


# schemathesis' own pytest entry (from_fixture) breaks on pytest 9, so each operation's
# strategy is driven by Hypothesis here; a 5xx fails with the shrunk request.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(api_schema, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:

        @FUZZ_SETTINGS
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case):
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # past the model check, into the parameters
            case.call_and_validate(checks=[not_a_server_error], timeout=10)

        call()

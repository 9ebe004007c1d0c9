"""The wrong-key throttle against a real uvicorn server started with the producer's own options
(``producer.main.server_options``; issue 33 item 10): ``X-Forwarded-For`` counts only from the
proxies ``--forwarded_allow_ips`` names (uvicorn's default trusted it from 127.0.0.1, so any local
client could claim a new address with every guess), and a throttled address still gets in with a
key that already worked from it, while any other key from it gets the 429 unchecked."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
import uvicorn
from pydantic import SecretStr, ValidationError

from producer.app import create_app
from producer.main import server_options
from shared.embedded_redis import free_port
from shared.producer_settings import ProducerSettings

OWNER, OTHER_KEY = "sk-owner-0123456789abcdef", "sk-second-0123456789abcdef"
LIMIT = 10


@contextlib.asynccontextmanager
async def producer(settings, tokenizer, **update):
    settings = settings.model_copy(
        update={"api_keys": SecretStr(f"{OWNER},{OTHER_KEY}"), "max_auth_failures": LIMIT, **update}
    )
    settings = settings.model_copy(update={"host": "127.0.0.1", "port": free_port()})
    options = {**server_options(settings), "log_level": "warning"}
    server = uvicorn.Server(uvicorn.Config(create_app(settings, tokenizer=tokenizer), **options))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.port}", timeout=30) as client:
            yield client
    finally:
        server.should_exit = True
        await task


async def get(client: httpx.AsyncClient, key: str, forwarded_for: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    return (await client.get("/v1/models", headers=headers)).status_code


async def test_forwarded_for_is_not_trusted_by_default(settings, tokenizer):
    async with producer(settings, tokenizer) as client:
        codes = [await get(client, f"sk-guess-{i}", f"203.0.113.{i}") for i in range(40)]
    # Every guess came from 127.0.0.1, whatever it claimed: the first 10 counted, the rest throttled.
    assert codes == [401] * LIMIT + [429] * (40 - LIMIT)


async def test_behind_a_named_proxy_each_forwarded_client_is_throttled_on_its_own(settings, tokenizer):
    async with producer(settings, tokenizer, forwarded_allow_ips="127.0.0.1") as client:
        assert [await get(client, f"sk-guess-{i}", "198.51.100.7") for i in range(LIMIT)] == [401] * LIMIT
        assert await get(client, "sk-guess-more", "198.51.100.7") == 429
        # Another client behind the same proxy is not held up by the first one's guesses.
        assert await get(client, "sk-wrong", "198.51.100.8") == 401
        assert await get(client, OWNER, "198.51.100.9") == 200
        # The proxy appends the address it saw: the client's own claim in front of it is not believed.
        assert await get(client, "sk-guess-spoofed", "1.2.3.4, 198.51.100.7") == 429


async def test_the_owner_keeps_working_from_a_throttled_address(settings, tokenizer):
    async with producer(settings, tokenizer) as client:
        assert await get(client, OWNER) == 200  # the owner, before anyone guessed from here
        assert [await get(client, f"sk-guess-{i}") for i in range(LIMIT)] == [401] * LIMIT
        assert await get(client, "sk-guess-more") == 429  # the address is throttled...
        assert await get(client, OWNER) == 200  # ...but not for a key that already worked from it
        # A key never used from here gets what a guess gets, right or not: nothing to learn.
        assert await get(client, OTHER_KEY) == 429


@pytest.mark.parametrize("value", ["not-an-ip", "10.0.0.5,proxy.local", "10.0.0.300"])
def test_a_proxy_list_that_names_no_address_is_refused_at_start(value):
    """uvicorn takes any other word as a literal no client address matches: a typo trusted no
    proxy, silently (red team 2)."""
    with pytest.raises(ValidationError, match="forwarded_allow_ips"):
        ProducerSettings(forwarded_allow_ips=value)
    assert ProducerSettings(forwarded_allow_ips="10.0.0.5, 10.0.0.0/24, ::1, *").forwarded_allow_ips

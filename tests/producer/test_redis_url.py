"""Redis URLs with an ACL user and password, over TLS (``rediss://``): the producer serves
through one, and the clients router and workers use (``shared.redis``) accept the same URL."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest
import redis

from producer.app import create_app
from producer.redis_client import producer_client
from shared.config import RedisSettings
from shared.embedded_redis import free_port
from shared.producer_settings import ProducerSettings
from shared.redis import sync_client
from tests.waiting import MUST_HAPPEN_S

USER, PASSWORD = "lightq", "s3cret-pw"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A TLS-only redis-server whose only user is an ACL user; yields its rediss:// URL."""
    server, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if server is None or openssl is None:
        pytest.skip("needs redis-server (built with TLS) and openssl")
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    process = subprocess.Popen(
        [
            server,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
            "--user",
            USER,
            "on",
            f">{PASSWORD}",
            "~*",
            "&*",
            "+@all",
            "--user",
            "default",
            "off",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"rediss://{USER}:{PASSWORD}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
    deadline = time.monotonic() + MUST_HAPPEN_S
    while True:
        try:
            if redis.Redis.from_url(url).ping():
                break
        except redis.RedisError:
            if process.poll() is not None:
                pytest.skip("this redis-server has no TLS support")
            if time.monotonic() > deadline:
                process.kill()
                pytest.fail("the TLS redis-server did not start")
            time.sleep(0.05)
    yield url
    process.terminate()
    process.wait(timeout=5)


async def test_producer_over_tls_with_an_acl_user(tls_redis, tokenizer):
    settings = ProducerSettings(redis=RedisSettings(url=tls_redis, key_prefix="lightq-tls-test"))
    app = create_app(settings, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://producer") as client:
            submitted = await client.post("/v1/requests", json={"inputs": [1, 2]})
            assert submitted.status_code == 202
            assert (await client.get(submitted.json()["status_url"])).json()["status"] == "queued"
    # What routers and workers open from the same URL.
    client = sync_client(RedisSettings(url=tls_redis))
    assert client.xlen("lightq-tls-test:{q}:requests") == 1
    client.close()


async def test_a_wrong_password_is_a_503(tls_redis, tokenizer):
    url = tls_redis.replace(PASSWORD, "wrong")
    app = create_app(ProducerSettings(redis=RedisSettings(url=url, key_prefix="lightq-tls-test")), tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://producer") as client:
            response = await client.post("/v1/requests", json={"inputs": [1, 2]})
            assert response.status_code == 503 and response.json()["error"]["code"] == "redis_unavailable"


def test_url_parts_reach_the_connection():
    settings = ProducerSettings(
        redis=RedisSettings(
            url="rediss://alice:p%40ss@redis.example:6380/3?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"
        )
    )
    pool = producer_client(settings).connection_pool
    kwargs = pool.connection_kwargs
    assert pool.connection_class.__name__ == "SSLConnection"
    assert (kwargs["username"], kwargs["password"], kwargs["host"], kwargs["port"], kwargs["db"]) == (
        "alice",
        "p@ss",
        "redis.example",
        6380,
        3,
    )
    assert kwargs["ssl_cert_reqs"] == "required" and kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    assert kwargs["socket_connect_timeout"] == settings.redis_timeout_s

"""``GET /v1/batches`` (newest first, paged) and batches owned by the API key that submitted them."""

from __future__ import annotations

import hashlib

import httpx
import pytest
from pydantic import SecretStr

from producer.app import create_app
from tests.batches.helpers import completion_line, jsonl, pool

KEY_A, KEY_B = "sk-batch-alpha-0123", "sk-batch-bravo-4567"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/jsonl"}


@pytest.fixture
async def keyed(settings, tokenizer):
    app = create_app(settings.model_copy(update={"api_keys": SecretStr(f"{KEY_A},{KEY_B}")}), tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app),
            base_url="http://producer",
            headers={"Content-Type": "application/jsonl"},
        ) as client:
            yield client


async def test_the_list_is_newest_first_and_pages_with_after(client):
    ids = []
    for i in range(3):
        response = await client.post(
            "/v1/batches", content=jsonl(completion_line(f"c{i}")), headers={"Content-Type": "application/jsonl"}
        )
        ids.append(response.json()["id"])
    first = (await client.get("/v1/batches", params={"limit": 2})).json()
    assert first["object"] == "list" and first["has_more"] is True
    # Created in one second, so order among equal times is by id; the pages still cover all three once.
    rest = (await client.get("/v1/batches", params={"limit": 2, "after": first["last_id"]})).json()
    assert rest["has_more"] is False and len(rest["data"]) == 1
    listed = [view["id"] for view in first["data"] + rest["data"]]
    assert sorted(listed) == sorted(ids)
    assert [view["created_at"] for view in first["data"] + rest["data"]] == sorted(
        (view["created_at"] for view in first["data"] + rest["data"]), reverse=True
    )
    assert first["first_id"] == listed[0] and rest["last_id"] == listed[-1]
    unknown = await client.get("/v1/batches", params={"after": "batch_" + "0" * 32})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "after"
    assert (await client.get("/v1/batches", params={"limit": 0})).status_code in (400, 422)


async def test_a_batch_belongs_to_its_key(keyed, worker, run_rq, aredis, keys):
    created = await keyed.post("/v1/batches", content=jsonl(completion_line("mine")), headers=auth(KEY_A))
    assert created.status_code == 202, created.text
    batch_id = created.json()["id"]
    for method, path in [
        ("GET", f"/v1/batches/{batch_id}"),
        ("GET", f"/v1/batches/{batch_id}/output"),
        ("POST", f"/v1/batches/{batch_id}/cancel"),
    ]:
        response = await keyed.request(method, path, headers=auth(KEY_B))
        assert response.status_code == 404, (path, response.text)
    assert (await keyed.get("/v1/batches", headers=auth(KEY_B))).json()["data"] == []
    assert [v["id"] for v in (await keyed.get("/v1/batches", headers=auth(KEY_A))).json()["data"]] == [batch_id]
    assert (await keyed.get("/v1/batches")).status_code == 401

    async with pool(worker) as taken:
        assert await run_rq()
    assert len(taken) == 1
    # The batch's request is the key's own too: its status hash names the key (by hash only).
    meta = await aredis.hgetall(keys.meta(taken[0].id))
    assert meta["key_hash"] == hashlib.sha256(KEY_A.encode()).hexdigest()
    view = (await keyed.get(f"/v1/batches/{batch_id}", headers=auth(KEY_A))).json()
    assert view["status"] == "completed" and "key_hash" not in view
    output = await keyed.get(f"/v1/batches/{batch_id}/output", headers=auth(KEY_A))
    assert output.status_code == 200 and "mine" in output.text

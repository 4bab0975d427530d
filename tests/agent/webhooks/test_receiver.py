from __future__ import annotations

from typing import Any

from agent.webhooks.receiver import build_receiver_app
from agent.webhooks.signing import sign_headers

SECRET = b"s3cret"


async def test_receiver_accepts_signed_and_ignores_duplicate_ids(aiohttp_client: Any) -> None:
    app, log = build_receiver_app(SECRET, clock=lambda: 1000.0)
    client = await aiohttp_client(app)
    body = b'{"alerts": []}'
    for _ in range(2):
        response = await client.post("/hook", data=body, headers=sign_headers(SECRET, "msg_1", 1000, body))
        assert response.status == 200
    assert log.messages == [{"alerts": []}] and log.duplicates == 1


async def test_receiver_rejects_wrong_secret_with_401(aiohttp_client: Any) -> None:
    app, log = build_receiver_app(SECRET, clock=lambda: 1000.0)
    client = await aiohttp_client(app)
    body = b"{}"
    response = await client.post("/hook", data=body, headers=sign_headers(b"other", "msg_1", 1000, body))
    assert response.status == 401 and log.messages == [] and "no webhook-signature" in log.rejected[0]

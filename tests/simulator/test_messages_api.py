"""``POST /v1/messages``: Anthropic's Messages API in the shapes real vLLM answers with.

The references are vLLM 0.32's own answers, recorded in tests/fixtures/gate (SOURCES.md there): the
simulator's events and fields must be the same, in the same order, or a client (or the gate, which counts
``content_block_delta`` events as tokens) would see something no engine sends.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from simulator import messages_api
from simulator.openai_api import ApiError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gate"
BODY = {"system": "be brief", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 5}


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event type, data) of each SSE event; comment lines are skipped as SSE clients skip them."""
    out = []
    for block in raw.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if lines:
            kind = lines[0].removeprefix("event: ")
            out.append((kind, json.loads(lines[1].removeprefix("data: "))))
    return out


def _shape(value: Any) -> Any:
    """Keys and value types, recursively: what must match between vLLM's answer and the simulator's."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(item) for item in value[:1]]
    return type(value).__name__


async def test_stream_has_vllms_events_in_vllms_order_with_its_fields(sim: Any) -> None:
    response = await sim.post("/v1/messages", json={**BODY, "stream": True})
    assert response.status == 200
    ours = _events(await response.read())
    theirs = _events((FIXTURES / "vllm-0.32.0-cpu-messages-stream.sse").read_bytes())
    assert [kind for kind, _ in ours] == [kind for kind, _ in theirs]  # both: 5 tokens
    assert [_shape(data) for _, data in ours] == [_shape(data) for _, data in theirs]
    assert all(data["type"] == kind for kind, data in ours)
    start, delta = ours[0][1]["message"], ours[-2][1]
    assert start["usage"] == {"input_tokens": 10 + 4 + 2, "output_tokens": 0}  # 40 chars, 1 message, system
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"] == {"input_tokens": 16, "output_tokens": 5}
    assert start["id"].startswith("chatcmpl-")


async def test_json_answer_has_vllms_fields(sim: Any) -> None:
    response = await sim.post("/v1/messages", json=BODY)
    ours = await response.json()
    theirs = json.loads((FIXTURES / "vllm-0.32.0-cpu-messages.json").read_text())
    assert _shape(ours) == _shape(theirs)
    assert ours["usage"] == {"input_tokens": 16, "output_tokens": 5}
    assert ours["stop_reason"] == "max_tokens" and ours["content"][0]["text"]


async def test_stamped_messages_stream_keeps_its_events_whole(aiohttp_client: Any, clock: Any) -> None:
    from simulator.engine import make_core
    from simulator.server import SimServer

    server = SimServer(make_core("a100-80g", "llama-2-7b", "fp16", 8), clock=clock, sleep=clock.sleep)
    server.stamp_chunks = True
    client = await aiohttp_client(server.app())
    raw = await (await client.post("/v1/messages", json={**BODY, "stream": True})).read()
    assert raw.count(b": sent_ns=") == len(_events(raw)) == 10


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens is required"),
        ({"messages": [], "max_tokens": 4}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens must be"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "system": 3}, "system must be"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": "yes"}, "stream must"),
    ],
)
def test_bad_requests_are_400s_that_name_the_field(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError, match=message) as caught:
        messages_api.parse(body, "m")
    assert caught.value.status == 400


def test_another_model_is_a_404() -> None:
    with pytest.raises(ApiError) as caught:
        messages_api.parse({**BODY, "model": "other"}, "m")
    assert caught.value.status == 404


def test_system_blocks_count_like_a_system_string() -> None:
    blocks = {**BODY, "system": [{"type": "text", "text": "be brief"}]}
    assert messages_api.parse(blocks, "m").prompt_tokens == messages_api.parse(BODY, "m").prompt_tokens

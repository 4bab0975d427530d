"""``POST /v1/responses``: OpenAI's Responses API in the shapes real vLLM answers with.

The references are vLLM 0.32's own answers, recorded in tests/fixtures/gate (SOURCES.md there): the
simulator's events and fields must be the same, in the same order, or a client (or the gate, which times
the first token at the first ``response.output_text.delta`` and counts tokens from the usage in
``response.completed``) would see something no engine sends. vLLM's CPU build sent its 5 tokens in 2
delta events; the simulator sends one per token, as vLLM does when it keeps up.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from simulator import responses_api
from simulator.openai_api import ApiError
from tests.simulator.test_messages_api import _events, _shape

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gate"
BODY = {"instructions": "be brief", "input": "x" * 40, "max_output_tokens": 5}
INPUT_TOKENS = 12 + 4 * 2  # 48 characters, two messages (the instructions are the system one)


def _collapsed(kinds: list[str]) -> list[str]:
    """Event types with each run of deltas as one."""
    return [kind for kind, _ in itertools.groupby(kinds)]


async def test_stream_has_vllms_events_in_vllms_order_with_its_fields(sim: Any) -> None:
    response = await sim.post("/v1/responses", json={**BODY, "stream": True})
    assert response.status == 200
    ours = _events(await response.read())
    theirs = _events((FIXTURES / "vllm-0.32.0-cpu-responses-stream.sse").read_bytes())
    kinds = [kind for kind, _ in ours]
    assert _collapsed(kinds) == _collapsed([kind for kind, _ in theirs])
    assert kinds.count("response.output_text.delta") == 5  # one per token
    # each event type's fields and their types as vLLM's (its first of each type)
    first_of = {kind: data for kind, data in reversed(theirs)}
    assert all(_shape(data) == _shape(first_of[kind]) for kind, data in ours), kinds
    assert [data["sequence_number"] for _, data in ours] == list(range(len(ours)))
    assert all(data["type"] == kind for kind, data in ours)
    created, completed = ours[0][1]["response"], ours[-1][1]["response"]
    assert created["id"].startswith("resp_") and created["id"] == completed["id"]
    assert created["status"] == "in_progress" and created["usage"] is None
    assert completed["status"] == "incomplete"  # cut by max_output_tokens, as vLLM's was
    assert completed["incomplete_details"] == {"reason": "max_output_tokens"}
    assert completed["usage"]["input_tokens"] == INPUT_TOKENS and completed["usage"]["output_tokens"] == 5
    deltas = "".join(data["delta"] for kind, data in ours if kind == "response.output_text.delta")
    assert completed["output"][0]["content"][0]["text"] == deltas == ours[-4][1]["text"]
    assert completed["instructions"] == "be brief" and completed["max_output_tokens"] == 5


async def test_json_answer_has_vllms_fields(sim: Any) -> None:
    response = await sim.post("/v1/responses", json=BODY)
    ours = await response.json()
    theirs = json.loads((FIXTURES / "vllm-0.32.0-cpu-responses.json").read_text())
    assert _shape(ours) == _shape(theirs)
    assert list(ours) == list(theirs)  # vLLM's field order too
    assert (ours["usage"]["input_tokens"], ours["usage"]["output_tokens"]) == (INPUT_TOKENS, 5)
    assert ours["usage"]["total_tokens"] == INPUT_TOKENS + 5
    assert ours["status"] == "incomplete" and ours["output"][0]["content"][0]["text"]


async def test_an_answer_that_ends_before_its_limit_is_completed(sim: Any) -> None:
    """Without ``max_output_tokens`` the simulator's answer (at most a chat answer's default length) ends
    on its own: status ``completed``, no ``incomplete_details``."""
    ours = await (await sim.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}]})).json()
    if ours["usage"]["output_tokens"] < ours["max_output_tokens"]:
        assert ours["status"] == "completed" and ours["incomplete_details"] is None
    else:
        assert ours["status"] == "incomplete"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_output_tokens": 4}, "input is required"),
        ({"input": []}, "input must be a string or a non-empty list"),
        ({"input": ["hi"]}, "each input item must be an object"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens must be"),
        ({"input": "hi", "instructions": 3}, "instructions must be a string"),
        ({"input": "hi", "stream": "yes"}, "stream must"),
    ],
)
def test_bad_requests_are_400s_that_name_the_field(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError, match=message) as caught:
        responses_api.parse(body, "m")
    assert caught.value.status == 400


def test_another_model_is_a_404() -> None:
    with pytest.raises(ApiError) as caught:
        responses_api.parse({**BODY, "model": "other"}, "m")
    assert caught.value.status == 404


def test_input_items_count_like_chat_messages_and_a_tool_output_like_a_message() -> None:
    as_string = responses_api.parse({"input": "y" * 40}, "m").prompt_tokens
    as_item = responses_api.parse({"input": [{"role": "user", "content": "y" * 40}]}, "m").prompt_tokens
    parts = [{"type": "input_text", "text": "y" * 40}]
    as_parts = responses_api.parse({"input": [{"role": "user", "content": parts}]}, "m").prompt_tokens
    assert as_string == as_item == as_parts == 10 + 4
    tool = {"type": "function_call_output", "call_id": "c", "output": "z" * 40}
    with_tool = responses_api.parse({"input": [{"role": "user", "content": "y" * 40}, tool]}, "m")
    assert with_tool.prompt_tokens == 20 + 4 * 2

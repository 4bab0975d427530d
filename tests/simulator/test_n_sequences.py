"""``n`` > 1 on completions and chat: several sequences for one prompt, as vLLM serves them.

vLLM fans a request with ``n`` out into that many requests in its engine, decodes them side by side and
interleaves their events in one stream, each naming its sequence in ``choices[].index`` (its recorded
stream, tests/fixtures/gate/vllm-0.32.0-cpu-completions-n2-stream.sse). Until 2026-12-04 the simulator
ignored ``n`` and answered one sequence, so a client (or the gate) asking for two got one.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from simulator.openai_api import MAX_N

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gate"


def _chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body, comments and ``[DONE]`` left out."""
    out = []
    for block in raw.decode().split("\n\n"):
        data = [line[5:].strip() for line in block.split("\n") if line.startswith("data:")]
        if data and data[0] != "[DONE]":
            out.append(json.loads(data[0]))
    return out


def _order(chunks: list[dict[str, Any]]) -> list[int]:
    return [chunk["choices"][0]["index"] for chunk in chunks if chunk["choices"]]


async def test_a_completion_stream_interleaves_its_sequences_like_vllms(sim: Any) -> None:
    body = {"prompt": "x" * 40, "max_tokens": 4, "n": 2, "stream": True}
    response = await sim.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    assert response.status == 200
    chunks = _chunks(await response.read())
    order = _order(chunks)
    assert Counter(order) == {0: 4, 1: 4}  # 4 tokens each, the last with the finish reason
    assert order != sorted(order)  # side by side, not one after the other
    vllms = _order(_chunks((FIXTURES / "vllm-0.32.0-cpu-completions-n2-stream.sse").read_bytes()))
    assert Counter(vllms) == Counter(order)  # the same events per sequence as vLLM's stream, same indices
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert sum(1 for c in mine if c["text"]) == 4 and mine[-1]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1  # one request, one id
    assert chunks[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18}


async def test_a_chat_stream_opens_each_sequence_with_its_role(sim: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3, "stream": True}
    chunks = _chunks(await (await sim.post("/v1/chat/completions", json=body)).read())
    first = {}
    for chunk in chunks:
        choice = chunk["choices"][0]
        first.setdefault(choice["index"], choice["delta"])
    assert first == {i: {"role": "assistant", "content": ""} for i in range(3)}
    assert Counter(_order(chunks)) == {0: 4, 1: 4, 2: 4}  # role, 3 tokens (the last one closes)
    vllms = _chunks((FIXTURES / "vllm-0.32.0-cpu-chat-n2-stream.sse").read_bytes())
    assert Counter(_order(vllms)) == {0: 5, 1: 5}  # vLLM's, with max_tokens 4: role, 4 tokens
    assert vllms[-1]["choices"][0]["delta"]["content"] and vllms[-1]["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"][0]["delta"]["content"] and chunks[-1]["choices"][0]["finish_reason"]


async def test_a_whole_answer_has_a_choice_per_sequence_and_counts_the_prompt_once(sim: Any) -> None:
    core = sim.sim_server.core
    before = core.stats.request_success["length"]
    body = {"prompt": "x" * 40, "max_tokens": 5, "n": 3, "logprobs": 0, "echo": True}
    answer = await (await sim.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["text"].startswith("x" * 40) and c["finish_reason"] == "length" for c in answer["choices"])
    assert all(len(c["logprobs"]["tokens"]) == 10 + 5 for c in answer["choices"])  # prompt and answer
    assert answer["usage"] == {"prompt_tokens": 10, "completion_tokens": 15, "total_tokens": 25}
    assert core.stats.request_success["length"] - before == 3  # a request of its own each, in the engine
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}
    answer = await (await sim.post("/v1/chat/completions", json=chat)).json()
    assert [c["message"]["role"] for c in answer["choices"]] == ["assistant", "assistant"]
    assert answer["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("n", [0, -1, True, "2", 1.5, MAX_N + 1])
async def test_a_bad_n_is_a_400_that_says_so(sim: Any, n: object) -> None:
    response = await sim.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": n})
    assert response.status == 400
    assert f"n must be an integer in [1, {MAX_N}]" in (await response.json())["error"]["message"]


async def test_n_null_is_one_sequence(sim: Any) -> None:
    answer = await (
        await sim.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": None})
    ).json()
    assert len(answer["choices"]) == 1


async def test_a_client_leaving_aborts_every_sequence(sim: Any) -> None:
    """The client goes after the first chunk: both sequences leave the engine (counted as aborts), and
    the task relaying the other one is not left waiting for tokens that will never come."""
    core = sim.sim_server.core
    body = {"prompt": "x" * 40, "max_tokens": 500, "n": 2, "stream": True}
    response = await sim.post("/v1/completions", json=body)
    await response.content.readany()
    response.close()
    for _ in range(1000):
        if core.num_running + core.num_waiting == 0:
            break
        await asyncio.sleep(0.001)
    assert core.num_running + core.num_waiting == 0
    assert core.stats.request_success["abort"] == 2
    assert sim.sim_server._streams == {}
    await asyncio.sleep(0)  # a cancelled task ends at its next step
    left = [t for t in asyncio.all_tasks() if "relay" in repr(t.get_coro())]
    assert left == []


async def test_a_list_of_prompts_is_a_sequence_per_prompt_and_per_n(sim: Any) -> None:
    """vLLM answers a completions ``prompt`` list with ``n`` choices per prompt, prompt p's i-th at index
    p x n + i, and a usage that sums the prompts."""
    core = sim.sim_server.core
    before = core.stats.request_success["length"]
    body = {"prompt": ["x" * 40, "y" * 80], "max_tokens": 3, "n": 2}
    answer = await (await sim.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert answer["usage"] == {"prompt_tokens": 10 + 20, "completion_tokens": 12, "total_tokens": 42}
    assert core.stats.request_success["length"] - before == 4
    streamed = await sim.post("/v1/completions", json={**body, "stream": True})
    assert Counter(_order(_chunks(await streamed.read()))) == {i: 3 for i in range(4)}


async def test_echo_and_logprobs_take_one_prompt(sim: Any) -> None:
    response = await sim.post("/v1/completions", json={"prompt": ["a", "b"], "echo": True})
    assert response.status == 400
    assert "one prompt" in (await response.json())["error"]["message"]

"""The HTTP face through aiohttp's test client, on a fake clock (nothing sleeps)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from simulator.kvcache import BLOCK_SIZE
from simulator.server import RECEIVED_HEADER, SimServer


async def _sse_events(response: Any) -> list[str]:
    """Read an SSE body chunk by chunk, returning each ``data:`` payload in order."""
    events: list[str] = []
    buffer = b""
    async for piece in response.content.iter_any():
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            assert event.startswith(b"data: ")
            events.append(event[len(b"data: ") :].decode())
    return events


async def test_streaming_completion_sends_one_chunk_per_token_then_done(sim: Any) -> None:
    response = await sim.post(
        "/v1/completions", json={"prompt": "hello " * 40, "max_tokens": 7, "stream": True}
    )
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = await _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 7 and all(c["choices"][0]["text"] for c in chunks)  # one event per token
    # the finish reason on the last token's event, as vLLM sends it (not on an empty event of its own)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]
    assert all(c["object"] == "text_completion" for c in chunks)


async def test_chat_stream_opens_with_role_and_reports_usage(sim: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "x" * 400}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await _sse_events(await sim.post("/v1/chat/completions", json=body))
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"] == {"prompt_tokens": 104, "completion_tokens": 3, "total_tokens": 107}


async def test_tokens_arrive_at_the_pace_of_the_model(sim: Any, clock: Any) -> None:
    start = clock()
    response = await sim.post("/v1/completions", json={"prompt": [1] * 32, "max_tokens": 101, "stream": True})
    await _sse_events(response)
    elapsed = clock() - start
    # 100 decode steps of a 7B model on an A100 at ~8 ms each, plus a short prefill.
    assert 0.7 < elapsed < 1.0


async def test_non_streaming_completion_honours_max_tokens(sim: Any) -> None:
    response = await sim.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 12})
    body = await response.json()
    assert response.status == 200
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    assert body["choices"][0]["finish_reason"] == "length"


async def test_bad_body_is_a_400_with_one_line(sim: Any) -> None:
    response = await sim.post(
        "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    body = await response.json()
    assert response.status == 400
    assert "\n" not in body["error"]["message"]


async def test_too_long_request_is_a_400(sim: Any) -> None:
    response = await sim.post("/v1/completions", json={"prompt": [1] * 4000, "max_tokens": 500})
    assert response.status == 400
    assert "maximum context length is 4096" in (await response.json())["error"]["message"]


async def test_models_lists_the_served_model(sim: Any) -> None:
    body = await (await sim.get("/v1/models")).json()
    assert [m["id"] for m in body["data"]] == ["meta-llama/Llama-2-7b-hf"]


async def test_metrics_count_tokens_with_vllm_names_and_labels(sim: Any) -> None:
    await sim.post("/v1/completions", json={"prompt": [1] * 20, "max_tokens": 5})
    text = await (await sim.get("/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    generation = families["vllm:generation_tokens"].samples[0]
    assert generation.value == 5
    assert generation.labels == {"model_name": "meta-llama/Llama-2-7b-hf", "engine": "0"}
    success = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert success["length"] == 1
    ttft_buckets = [
        s.labels["le"]
        for s in families["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-1] == "+Inf"
    config = families["vllm:cache_config_info"].samples[0].labels
    assert config["block_size"] == str(BLOCK_SIZE)


async def test_slow_metrics_fault_delays_the_answer(sim: Any, clock: Any) -> None:
    await sim.post("/sim/faults", json={"metrics_delay_s": 3})
    start = clock()
    assert (await sim.get("/metrics")).status == 200
    assert clock() - start >= 3


async def test_error_fault_answers_5xx(sim: Any) -> None:
    await sim.post("/sim/faults", json={"error_rate": 1.0, "error_status": 500})
    response = await sim.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert response.status == 500


async def test_bad_fault_switch_is_a_422(sim: Any) -> None:
    response = await sim.post("/sim/faults", json={"error_rate": 2})
    assert response.status == 422
    assert "error_rate must be in [0, 1]" in (await response.json())["error"]["message"]


async def test_faults_read_back(sim: Any) -> None:
    await sim.post("/sim/faults", json={"latency_factor": 3})
    assert (await (await sim.get("/sim/faults")).json())["latency_factor"] == 3


async def test_nvml_reports_busy_gpu_while_serving(sim: Any) -> None:
    await sim.post("/v1/completions", json={"prompt": [1] * 64, "max_tokens": 200})
    gpu = (await (await sim.get("/sim/nvml")).json())["gpus"][0]
    assert gpu["utilization_gpu_ratio"] > 0.9
    assert gpu["power_w"] > 200
    assert gpu["energy_j"] > 0


async def test_probe_serves_the_probe_families(sim: Any) -> None:
    text = await (await sim.get("/sim/probe/metrics")).text()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {
        "servepilot_probe_up",
        "servepilot_probe_reserved_bytes",
        "servepilot_probe_fragmentation_ratio",
        "servepilot_probe_ooms",
        "servepilot_probe_info",
    } <= names


async def test_apply_then_lease_expiry_returns_to_safe_defaults(sim: Any, clock: Any) -> None:
    body = {"settings": {"max_num_seqs": 16, "sm_clock_mhz": 1100}, "idempotency_key": "k1", "lease_s": 30}
    assert (await sim.post("/v1/control/apply", json=body)).status == 200
    assert (await (await sim.get("/v1/control/state")).json())["settings"]["max_num_seqs"] == 16
    clock.advance(31)
    state = await (await sim.get("/v1/control/state")).json()
    assert state["settings"] == state["safe_defaults"]
    assert state["lease"]["active"] is False


async def test_renewed_lease_keeps_the_setting(sim: Any, clock: Any) -> None:
    body = {"settings": {"max_num_seqs": 16}, "idempotency_key": "k2", "lease_s": 30}
    await sim.post("/v1/control/apply", json=body)
    clock.advance(20)
    assert (await sim.post("/v1/control/lease", json={"lease_s": 30})).status == 200
    clock.advance(20)
    assert (await (await sim.get("/v1/control/state")).json())["settings"]["max_num_seqs"] == 16


async def test_out_of_bounds_apply_is_a_422(sim: Any) -> None:
    body = {"settings": {"sm_clock_mhz": 5000}, "idempotency_key": "k3"}
    response = await sim.post("/v1/control/apply", json=body)
    assert response.status == 422
    assert "settings.sm_clock_mhz must be in [210, 1410]" in (await response.json())["error"]["message"]


async def _gauges(sim: Any) -> dict[str, float]:
    text = await (await sim.get("/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {
        name: families[name].samples[0].value
        for name in ("vllm:generation_tokens", "vllm:num_requests_running")
    }


async def test_a_stalled_engine_holds_its_requests_while_health_and_metrics_answer(sim: Any) -> None:
    """A hung engine (a collective that never returns): what the engine-stall detector must tell from a
    busy one. Its HTTP side answers, so a health check passes; the token counter stops."""
    response = await sim.post("/v1/completions", json={"prompt": [1] * 8, "max_tokens": 40, "stream": True})
    await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)  # the first token came
    await sim.post("/sim/faults", json={"stalled": True})
    before = await _gauges(sim)
    await asyncio.sleep(0.05)  # the engine loop runs meanwhile (the fake clock does not move it)
    after = await _gauges(sim)
    assert after == before and after["vllm:num_requests_running"] == 1
    assert before["vllm:generation_tokens"] < 40
    assert (await sim.get("/health")).status == 200
    await sim.post("/sim/faults", json={"stalled": False})
    events = await asyncio.wait_for(_sse_events(response), 5)
    assert events[-1] == "[DONE]"
    assert (await _gauges(sim))["vllm:generation_tokens"] == 40


async def test_stalled_must_be_a_boolean(sim: Any) -> None:
    response = await sim.post("/sim/faults", json={"stalled": "yes"})
    assert response.status == 422
    assert (await response.json())["error"]["message"] == "stalled must be true or false, got 'yes'"


async def test_stalled_gpu_must_be_busy_or_idle(sim: Any) -> None:
    response = await sim.post("/sim/faults", json={"stalled_gpu": "spinning"})
    assert response.status == 422
    assert (await response.json())["error"]["message"] == (
        "stalled_gpu must be one of ['busy', 'idle'], got 'spinning'"
    )


async def test_stamped_stream_times_the_arrival_and_every_event_on_the_monotonic_clock(
    aiohttp_client: Any, clock: Any, small_core: Any
) -> None:
    """bench/gate.py subtracts these stamps from its own ``time.monotonic_ns()``: they must be on that
    clock (not the server's injected one), in order, and in a comment line SSE clients skip."""
    server = SimServer(small_core, clock=clock, sleep=clock.sleep, stamp_chunks=True)
    client = await aiohttp_client(server.app())
    before = time.monotonic_ns()
    response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
    body = await response.read()
    after = time.monotonic_ns()
    received = int(response.headers[RECEIVED_HEADER])
    events = body.split(b"\n\n")[:-1]
    stamps = [int(event.split(b"\n")[0].removeprefix(b": sent_ns=")) for event in events]
    assert all(event.startswith(b": sent_ns=") for event in events)
    assert [event.split(b"\n")[1][:6] for event in events] == [b"data: "] * 5  # 4 tokens, [DONE]
    assert before <= received <= stamps[0]
    assert stamps == sorted(stamps) and stamps[-1] <= after


async def test_streams_carry_no_stamps_unless_asked(sim: Any) -> None:
    response = await sim.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert RECEIVED_HEADER not in response.headers
    assert b"sent_ns" not in await response.read()


async def test_the_priority_policy_serves_a_requests_priority_field_lower_first(
    aiohttp_client: Any, clock: Any
) -> None:
    """vLLM's ``--scheduling-policy priority``: the body's ``priority`` orders the queue. One sequence at
    a time; ``low`` is queued before ``high`` while the engine holds everything, and ``high`` is served
    first once it runs."""
    from simulator.engine import make_core

    core = make_core("a100-80g", "llama-2-7b", "fp16", 1, scheduling_policy="priority")
    client = await aiohttp_client(SimServer(core, clock=clock, sleep=clock.sleep, seed=1).app())
    await client.post("/sim/faults", json={"stalled": True})
    posts = {}
    for name, priority in (("low", 1), ("high", -1)):
        body = {"prompt": [1] * 8, "max_tokens": 4, "priority": priority}
        posts[name] = asyncio.ensure_future(client.post("/v1/completions", json=body))
        while core.num_waiting < len(posts):
            await asyncio.sleep(0)
    assert [r.priority for r in core.scheduler.waiting] == [-1, 1]
    await client.post("/sim/faults", json={"stalled": False})
    done, _ = await asyncio.wait(posts.values(), return_when=asyncio.FIRST_COMPLETED)
    assert done == {posts["high"]}
    assert [(await post).status for post in posts.values()] == [200, 200]


async def test_a_priority_that_is_not_an_integer_is_a_400(sim: Any) -> None:
    response = await sim.post(
        "/v1/completions", json={"prompt": [1] * 8, "max_tokens": 4, "priority": "high"}
    )
    assert response.status == 400
    assert (await response.json())["error"]["message"] == "priority must be an integer, got 'high'"

"""End to end against a real llama.cpp server (PyPI ``xllamacpp``, tiny random-weight GGUF model, 4 slots).

What a sidecar that has only met its own simulator cannot prove: that the gate relays a real engine's SSE
byte for byte (to raw HTTP and to the official ``openai`` client alike), that its in-flight limit holds
against the engine's real slots, that the collectors' readings agree with the traffic the test sent, and
that a detector notices when a noisy neighbour (CPU contention) slows the real engine down.

Runs in every CI run (``scripts/engines.sh llamacpp`` installs the engine in ~20 s); locally it is skipped
with that command when the engine is not installed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from agent.collectors.engine_metrics import EngineMetricsCollector, parse
from agent.collectors.llamacpp_slots import LlamaCppSlotsCollector
from agent.collectors.metric_mapping import load_mappings
from agent.config import EngineConfig
from agent.engines.launcher import SERVED_MODEL, LaunchOptions, RunningEngine
from agent.gate.collector import GateCollector
from detectors.base import Finding
from detectors.scheduler import SchedulerEfficiencyDetector
from detectors.snapshot import Snapshot
from tests.engines.client import completion, gate_for, gate_tokens, normalised, sampled, stream, stream_many
from tests.engines.fixture import running
from tests.engines.tap import Tap
from tests.engines.throttle import throttled

SLOTS = 4


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    with running("llamacpp") as server:
        yield server


async def _busy(slots: LlamaCppSlotsCollector) -> float:
    """The engine's busy slots now (-1 when /slots did not answer)."""
    return (await slots.collect(now=0.0)).values.get("engine.slots_busy", -1.0)


# --- the gate relays the engine's bytes ---------------------------------------------------------------


async def test_gate_relays_exactly_the_bytes_the_engine_sent(engine: RunningEngine) -> None:
    tap = Tap("127.0.0.1", engine.port)
    tap_port = await tap.start()
    try:
        async with gate_for(f"http://127.0.0.1:{tap_port}") as (_, url, _), aiohttp.ClientSession() as s:
            results = [await stream(s, url, completion(f"the server {i}", 24)) for i in range(3)]
    finally:
        await tap.stop()
    # the gate's own health checks pass the tap too: keep the completion streams
    sent = [(status, body) for status, body in tap.response_bodies() if body.startswith(b"data:")]
    assert [status for status, _ in sent] == [200, 200, 200], [len(r) for r in tap.recorded]
    # every byte, event framing and usage chunk included (the prompts differ, so the bodies do too)
    assert sorted(r.body for r in results) == sorted(body for _, body in sent)
    for result in results:
        assert result.status == 200
        assert result.events[-1] == "[DONE]" and len(result.events) == 24 + 2  # tokens, final chunk, DONE


async def test_gate_stream_equals_a_direct_request_at_temperature_zero(engine: RunningEngine) -> None:
    body = completion("the batch engine", 32, cache_prompt=False)
    async with gate_for(engine.url) as (_, url, _), aiohttp.ClientSession() as session:
        direct = await stream(session, engine.url, body)
        gated = await stream(session, url, body)
    assert direct.status == gated.status == 200
    assert direct.usage["completion_tokens"] == 32
    # only the per-request id, creation time and llama.cpp's own timings may differ
    assert normalised(gated.body) == normalised(direct.body)
    assert gated.text == direct.text and len(gated.text) > 32


async def test_openai_client_through_the_gate_gets_the_direct_tokens(engine: RunningEngine) -> None:
    async def chunks(base_url: str) -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        extra = {"ignore_eos": True, "cache_prompt": False}
        texts = []
        async for chunk in await client.completions.create(
            model=SERVED_MODEL, prompt="the model", max_tokens=16, stream=True, temperature=0.0, seed=7,
            extra_body=extra,
        ):  # fmt: skip
            texts.extend(choice.text for choice in chunk.choices)
        deltas = []
        async for chunk in await client.chat.completions.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16,
            stream=True, temperature=0.0, seed=7, extra_body=extra,
        ):  # fmt: skip
            deltas.extend(choice.delta.content or "" for choice in chunk.choices)
        await client.close()
        return texts, deltas

    direct = await chunks(engine.url)
    async with gate_for(engine.url) as (_, url, registry):
        gated = await chunks(url)
        ok = registry.get_sample_value(
            "servepilot_gate_requests_total", {"line": "default", "priority": "normal", "outcome": "ok"}
        )
    assert gated == direct
    assert sum(1 for t in gated[0] if t) == 16 and sum(1 for t in gated[1] if t) == 16
    assert ok == 2


# --- the in-flight limit against real slots ---------------------------------------------------------


async def test_in_flight_limit_holds_against_the_real_slots(engine: RunningEngine) -> None:
    slots = LlamaCppSlotsCollector(EngineConfig(url=engine.url, kind="llamacpp"))
    busy_seen: list[float] = []
    queue_seen: list[float] = []
    async with (
        gate_for(engine.url, max_in_flight=2, high_reserved_ratio=0.0) as (gate, url, _),
        aiohttp.ClientSession() as session,
    ):
        load = asyncio.create_task(
            stream_many(session, url, [completion(f"slot {i}", 256) for i in range(6)])
        )
        while not load.done():
            reading = await slots.collect(now=0.0)
            busy_seen.append(reading.values.get("engine.slots_busy", -1.0))
            queue_seen.append(gate.snapshot_values()["gate.queue_depth"])
            await asyncio.sleep(0.01)
        results = load.result()
    await slots.close()
    assert [r.status for r in results] == [200] * 6
    assert all(r.usage["completion_tokens"] == 256 for r in results)
    assert max(busy_seen) == 2  # reached the limit, never beyond it, though the engine has 4 slots
    assert max(queue_seen) >= 1


async def test_the_native_completion_api_is_held_to_the_limit_and_counted_from_its_answers(
    engine: RunningEngine,
) -> None:
    """llama.cpp's own ``POST /completion`` (not the OpenAI path): before, the gate passed it straight
    through, past the limit. Now the engine's slots never run more than the limit, and the gate's token
    counts are the ``tokens_evaluated``/``tokens_predicted`` llama.cpp reports, streamed or not."""
    slots = LlamaCppSlotsCollector(EngineConfig(url=engine.url, kind="llamacpp"))

    async def native(session: aiohttp.ClientSession, url: str, i: int, stream: bool) -> dict[str, Any]:
        body = {"prompt": f"native {i}", "n_predict": 128, "stream": stream}
        async with session.post(url + "/completion", json=body) as r:
            assert r.status == 200
            if not stream:
                return dict(await r.json())
            events = [line for line in (await r.text()).splitlines() if line.startswith("data:")]
            return dict(json.loads(events[-1].removeprefix("data:")))  # the last one counts it all

    async with (
        gate_for(engine.url, max_in_flight=2, high_reserved_ratio=0.0) as (_, url, registry),
        aiohttp.ClientSession() as session,
        sampled(functools.partial(_busy, slots), 0.01) as busy_seen,
    ):
        answers = await asyncio.gather(*(native(session, url, i, stream=i % 2 == 0) for i in range(6)))
    await slots.close()
    assert all(a["stop"] and a["tokens_predicted"] > 0 for a in answers), answers
    assert max(busy_seen) == 2  # the limit, though the engine has 4 slots
    tokens = gate_tokens(registry)
    assert tokens == {
        "prompt": sum(a["tokens_evaluated"] for a in answers),
        "output": sum(a["tokens_predicted"] for a in answers),
    }, tokens


async def test_each_prompt_of_a_native_two_prompt_stream_is_timed_by_its_own_tokens(
    engine: RunningEngine,
) -> None:
    """llama.cpp's ``/completion`` with two prompts streams both answers interleaved, each event naming
    its prompt by a top-level ``index``: the gate's ITL is each answer's own gaps, as many and as long
    as the client measures them per index (before 2026-12-04 it recorded none for such a stream)."""
    body = {"prompt": ["Say hello", "Say bye"], "n_predict": 24, "stream": True, "ignore_eos": True}
    async with gate_for(engine.url) as (_, base, registry), aiohttp.ClientSession() as session:
        result = await stream(session, base, body, path="/completion")
    assert result.status == 200, result.body[-400:]
    expected = result.sequence_gaps()
    assert len(expected) == 2 * (24 - 1) + 2, result.body[-400:]  # and each answer's closing event
    bucket = {"bucket": "le256"}
    assert registry.get_sample_value("servepilot_gate_itl_seconds_count", bucket) == len(expected)
    # the tiny model decodes both answers in ~15 ms, and the client reads the gate's writes two events
    # at a time: the sums agree in size only (the exact pairing is tests/agent/gate/test_sequences.py's)
    itl_sum = registry.get_sample_value("servepilot_gate_itl_seconds_sum", bucket)
    assert itl_sum == pytest.approx(sum(expected), rel=0.5, abs=0.01), (itl_sum, expected)


async def test_chat_without_v1_and_anthropic_messages_are_held_to_the_limit_and_counted(
    engine: RunningEngine,
) -> None:
    """llama.cpp serves OpenAI's chat at ``/chat/completions`` too (no ``/v1``) and Anthropic's
    ``/v1/messages``; until 2026-12-02 the gate passed both straight through. Its Messages usage counts
    the prompt as ``input_tokens`` plus ``cache_read_input_tokens`` (the chat template's prefix is served
    from its cache: 1 + 50 for a one-word prompt), which the gate adds back up."""
    slots = LlamaCppSlotsCollector(EngineConfig(url=engine.url, kind="llamacpp"))
    messages = [{"role": "user", "content": "hello"}]

    async def send(session: aiohttp.ClientSession, url: str, i: int) -> tuple[float, float]:
        if i % 2:
            body = {"model": SERVED_MODEL, "max_tokens": 96, "messages": messages}
            async with session.post(url + "/v1/messages", json=body) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
            return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0), usage["output_tokens"]
        async with session.post(
            url + "/chat/completions", json={"messages": messages, "max_tokens": 96}
        ) as r:
            assert r.status == 200
            usage = (await r.json())["usage"]
        return usage["prompt_tokens"], usage["completion_tokens"]

    async with (
        gate_for(engine.url, max_in_flight=2, high_reserved_ratio=0.0) as (_, url, registry),
        aiohttp.ClientSession() as session,
        sampled(functools.partial(_busy, slots), 0.01) as busy_seen,
    ):
        counted = await asyncio.gather(*(send(session, url, i) for i in range(6)))
    await slots.close()
    assert max(busy_seen) == 2  # the limit, though the engine has 4 slots
    tokens = gate_tokens(registry)
    assert tokens == {"prompt": sum(c[0] for c in counted), "output": sum(c[1] for c in counted)}, tokens
    assert all(prompt > 10 for prompt, _ in counted), counted  # the template's tokens are in each


async def test_each_input_to_embed_takes_a_slot_of_the_limit() -> None:
    """A list of inputs to ``/v1/embeddings``: llama.cpp embeds each one in a slot of its own, so the gate
    charges a slot per input. With a limit of 3 and requests of two inputs, one request runs at a time:
    the engine's busy slots peak at 2 (charged a slot per request, three requests, six inputs, ran on all
    four slots). Each input is about 800 tokens, so the request's length bucket is one input's (``le1k``),
    not the pair's, while the gate counts every prompt token llama.cpp reports. Its own engine, with
    embeddings on beside generation."""
    words = " ".join(f"word{i}" for i in range(150))
    bodies = [{"model": SERVED_MODEL, "input": [f"{words} {i}a", f"{i}b {words}"]} for i in range(4)]
    with running("llamacpp", LaunchOptions(embeddings=True, ctx=16384)) as engine:
        slots = LlamaCppSlotsCollector(EngineConfig(url=engine.url, kind="llamacpp"))

        async def embed(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(url + "/v1/embeddings", json=body) as r:
                assert r.status == 200, await r.text()
                return dict(await r.json())

        async with (
            gate_for(engine.url, max_in_flight=3, high_reserved_ratio=0.0) as (_, url, registry),
            aiohttp.ClientSession() as session,
            sampled(functools.partial(_busy, slots), 0.005) as busy_seen,
        ):
            answers = await asyncio.gather(*(embed(session, url, body) for body in bodies))
        await slots.close()
    assert [len(a["data"]) for a in answers] == [2] * 4
    prompt_tokens = [a["usage"]["prompt_tokens"] for a in answers]
    assert all(2 * 256 < t <= 2 * 1024 for t in prompt_tokens), prompt_tokens  # a pair would be le4k
    assert max(busy_seen) == 2, collections.Counter(busy_seen)
    assert gate_tokens(registry)["prompt"] == sum(prompt_tokens)
    assert registry.get_sample_value("servepilot_gate_e2e_seconds_count", {"bucket": "le1k"}) == 4


# --- the collectors agree with the traffic ----------------------------------------------------------


async def test_collector_readings_agree_with_what_was_sent(engine: RunningEngine) -> None:
    mapping = load_mappings()["llamacpp"]
    cfg = EngineConfig(url=engine.url, kind="llamacpp")
    collector = EngineMetricsCollector(cfg)
    async with aiohttp.ClientSession() as session:

        async def counters() -> dict[str, float]:
            async with session.get(engine.url + "/metrics") as resp:
                return dict(parse(await resp.text(), mapping, now=0.0).counters)

        before = await counters()
        await collector.collect(now=100.0)
        async with gate_for(engine.url) as (_, url, registry):
            prompts = [f"the request number {i} " * (i + 1) for i in range(5)]
            results = await stream_many(session, url, [completion(p, 20) for p in prompts])
            gate_ok = registry.get_sample_value(
                "servepilot_gate_requests_total", {"line": "default", "priority": "normal", "outcome": "ok"}
            )
            gate_out = registry.get_sample_value(
                "servepilot_gate_tokens_total", {"line": "default", "kind": "output"}
            )
            gate_prompt = registry.get_sample_value(
                "servepilot_gate_tokens_total", {"line": "default", "kind": "prompt"}
            )
        after = await counters()
        reading = await collector.collect(now=110.0)
    await collector.close()
    prompt_sent = sum(r.usage["prompt_tokens"] for r in results)
    assert all(r.status == 200 for r in results)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["generation_tokens_per_second"] == 5 * 20
    # llama.cpp counts prompt tokens served from its cache apart from those it computed
    assert delta["prompt_tokens_per_second"] + delta["prompt_tokens_cached_per_second"] == prompt_sent
    assert delta["decode_steps_per_second"] >= 20  # at least one decode call per generated position
    assert reading.values["engine.generation_tokens_per_second"] == pytest.approx(100 / 10.0)
    assert reading.values["engine.requests_running"] == 0
    assert (gate_ok, gate_out, gate_prompt) == (5, 100, prompt_sent)


# --- a detector sees the engine slowed down ------------------------------------------------------------


# Timing-sensitive on 2 shared cores (real engine, wall-clock load): one rerun, reported by pytest as
# "rerun", never hidden; a real regression fails both attempts.
@pytest.mark.flaky(reruns=1)
async def test_scheduler_detector_flags_cpu_throttling_of_the_engine() -> None:
    """CPU-quota throttling (the engine stopped 75% of each 200 ms, as a CFS quota does to a pod) at an
    unchanged batch: the scheduler-efficiency detector sees throughput fall below what the batch predicts.

    Ticks are 0.25 s of real time; the detector is told 1 s per tick (it only needs ``now`` to advance).
    Its own engine, so the throttling cannot leak into other tests. The load is 3 workers sending
    non-streamed 128-token requests back to back: the engine, not this process relaying token chunks on a
    shared core, is the bottleneck, so the batch stays near 3 and the throughput is the engine's.
    """
    # its throughput smoothed over 32 busy ticks: 8 s here, as the default 8 ticks are at the sidecar's 1 s
    # (llama.cpp counts a request's 128 tokens when it ends, so 0.25 s ticks read in steps of 512 tok/s,
    # and over 8 of them a few late completions on a shared core looked like a 15% shortfall). The bar is
    # 30%, not the default 15%: even smoothed, the healthy engine read 16% short once in CI (2026-12-04,
    # "1492 tok/s is 16% below the 1777 tok/s a batch of 2.8 should give"), while the throttling takes
    # about 75% of its throughput. The 15% bar is tested in tests/detectors/test_scheduler.py.
    detector = SchedulerEfficiencyDetector(threshold=0.3, warmup=30, smooth=32)
    stop = asyncio.Event()
    quiet: list[str] = []
    found: list[Finding] = []
    began: int | None = None
    statuses: collections.Counter[int | str] = collections.Counter()  # a status, or an exception's name
    skipped = collections.Counter[str]()  # why a tick taught the detector nothing
    with running("llamacpp") as engine:
        cfg = EngineConfig(url=engine.url, kind="llamacpp")
        collectors = (EngineMetricsCollector(cfg), LlamaCppSlotsCollector(cfg))
        async with gate_for(engine.url) as (gate, url, _), aiohttp.ClientSession() as session:
            sources = (*collectors, GateCollector(gate))

            async def worker(i: int) -> None:
                while not stop.is_set():
                    try:
                        statuses[
                            (await stream(session, url, completion(f"worker {i}", 128, stream=False))).status
                        ] += 1
                    except aiohttp.ClientError as error:  # counted and shown on failure, load goes on
                        statuses[type(error).__name__] += 1
                        await asyncio.sleep(0.1)

            workers = [asyncio.create_task(worker(i)) for i in range(3)]
            try:
                with contextlib.ExitStack() as throttle:  # continued before the workers stop
                    for tick in range(1, 241):
                        await asyncio.sleep(0.25)  # real engine time passes between ticks
                        readings = await asyncio.gather(*(c.collect(float(tick)) for c in sources))
                        snapshot = Snapshot.from_readings(float(tick), {r.source: r for r in readings})
                        if not snapshot.get("engine.generation_tokens_per_second"):
                            skipped["no tokens"] += 1
                        if (snapshot.get("engine.batch_size_mean") or 0.0) < detector.min_batch:
                            skipped["batch < 1"] += 1
                        findings = detector.update(snapshot)
                        if began is None:
                            quiet.extend(f.summary for f in findings)
                        elif findings:
                            found = findings
                            break
                        elif tick - began >= 60:
                            break
                        # throttle once the model has learned the healthy engine: llama.cpp counts tokens
                        # when a request ends, so on a busy machine many short ticks show none and are
                        # skipped, and a fixed tick could fall inside the warm-up (which learns anything)
                        if began is None and tick >= 50 and detector.model_.n_ >= detector.warmup + 10:
                            began = tick
                            throttle.enter_context(throttled(engine.proc.pid))
            finally:
                stop.set()
                await asyncio.gather(*workers, return_exceptions=True)
        for collector in collectors:
            await collector.close()
    assert quiet == []
    assert began is not None, (
        f"the detector never warmed up ({detector.model_.n_} busy ticks learned; {tick} ticks, "
        f"{dict(skipped)}; responses {dict(statuses)}; load average {os.getloadavg()[0]:.1f}, "
        f"{threading.active_count()} threads here)"
    )
    assert found, "no finding while the engine ran throttled"
    assert found[0].signal == "engine.generation_tokens_per_second"
    print(f"\nthrottling from tick {began} flagged {tick - began} ticks later: {found[0].summary}")

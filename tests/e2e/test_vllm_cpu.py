"""End to end against a real vLLM 0.32 (CPU backend, tiny random-weight Llama, ``max_num_seqs`` 4).

Real ``vllm:*`` scrapes parse and map through the name table; capability discovery finds the runtime
endpoints this build serves in development mode (``VLLM_SERVER_DEV_MODE=1``) and the sleep/wake lever
really holds and releases requests; and the ``auto`` batch policy, driving the gate's in-flight limit
on a replayed trace scaled to the engine's capacity, gets within 15% of the best static limit's goodput.

In CI after ``scripts/engines.sh vllm`` (~3-6 min install, ~4 GiB, cached); locally skipped with that
command when vLLM is not installed. One server for the module: its cold start takes 1-2 minutes.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from agent.collectors.engine_metrics import EngineMetricsCollector, parse
from agent.collectors.exposition import parse_exposition
from agent.collectors.metric_mapping import detect_engine, load_mappings
from agent.config import ControlConfig, EngineConfig
from agent.control.client import ControlClient
from agent.control.vllm import VllmAdapter
from agent.engines.launcher import RunningEngine
from agent.gate.proxy import Gate
from policies.batch_auto import AutoBatch
from tests.engines.client import (
    ONE_AT_A_TIME,
    completion,
    gate_for,
    gate_tokens,
    sampled,
    stream,
    stream_many,
)
from tests.engines.closed_loop import RunResult, Slo, capacity, replay, scaled_trace
from tests.engines.fixture import running

MAPPINGS = load_mappings()
EJECT_S = 8.0
"""The stall test's ``gate.eject_stalled_s`` (see there)."""
SLICE_S = 0.05
"""How long the stall test lets vLLM's engine core run at a time while the four long answers start."""
QUIET_S = 1.0
"""After a slice, how long the gate's count of answers without a byte must hold still before the next."""


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    with running("vllm") as server:
        yield server


async def _scrape(session: aiohttp.ClientSession, engine: RunningEngine) -> str:
    async with session.get(engine.url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


# --- real scrapes parse and map -----------------------------------------------------------------------


def test_vllms_ipc_sockets_live_in_the_engines_own_folder(engine: RunningEngine) -> None:
    """Not in /tmp, where vLLM leaves them when it stops; the folder goes with the engine (unit test)."""
    assert engine.scratch is not None and engine.scratch.name.startswith(f"vllm-ipc-{engine.port}-")
    assert any(path.is_socket() for path in engine.scratch.iterdir())


async def test_live_scrapes_parse_and_map_to_the_canonical_signals(engine: RunningEngine) -> None:
    async with aiohttp.ClientSession() as session:
        before_text = await _scrape(session, engine)
        results = await stream_many(session, engine.url, [completion(f"scrape {i}", 24) for i in range(4)])
        after_text = await _scrape(session, engine)
    assert detect_engine(before_text, MAPPINGS) is MAPPINGS["vllm"]
    before = parse(before_text, MAPPINGS["vllm"], now=0.0)
    after = parse(after_text, MAPPINGS["vllm"], now=1.0)
    assert after.errors == () and after.legacy_names == ()  # 0.32 uses only the current names
    assert after.model == "tiny-random-llama"
    assert {"requests_running", "requests_waiting", "kv_cache_usage_ratio"} <= set(after.gauges)
    assert {"ttft_seconds", "itl_seconds", "e2e_seconds", "queue_seconds"} <= set(after.histograms)
    assert all(r.status == 200 for r in results)
    finished = (
        after.counters["requests_finished_per_second"] - before.counters["requests_finished_per_second"]
    )
    generated = (
        after.counters["generation_tokens_per_second"] - before.counters["generation_tokens_per_second"]
    )
    assert (finished, generated) == (4, 4 * 24)
    e2e_count = after.histograms["e2e_seconds"].count or 0
    assert e2e_count - (before.histograms["e2e_seconds"].count or 0) == 4


# --- the Responses API through the gate ---------------------------------------------------------------


Answer = tuple[int, dict[str, Any]]


async def _plain_then_streams(
    gate: Gate,
    url: str,
    body: dict[str, Any],
    streamed: Callable[[aiohttp.ClientSession, str], Awaitable[Answer]],
    engine: RunningEngine,
) -> tuple[Answer, list[Answer], list[float]]:
    """One plain request to ``url``, then three ``streamed`` at once: the status and JSON of the first,
    what ``streamed`` made of each stream, and the gate's queue depth sampled meanwhile.

    The three are sent while vLLM sleeps (the sleep lever holds a request until wake-up), and vLLM wakes
    once the gate holds one at vLLM and queues two, or after 10 s: sent to an awake engine, answers of a
    token or two (the random model may stop at once) ended before the next reached the gate, and a CI
    run (2026-12-05) saw no queue at all."""

    async def depth() -> float:
        return float(gate.admission.queue_depth)

    client = ControlClient(ControlConfig(enabled=True, url=engine.url, adapter="vllm"))
    await client.start()
    async with (
        sampled(depth, 0.005) as queued,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
    ):
        async with session.post(url, json=body) as r:
            plain = (r.status, await r.json())
        try:
            assert (await client.apply({"sleeping": True})).ok
            pending = asyncio.gather(*(streamed(session, url) for _ in range(3)))
            for _ in range(400):
                if gate.admission.queue_depth >= 2:
                    break
                await asyncio.sleep(0.025)
        finally:
            await client.apply({"sleeping": False})
            await client.close()
        streams = await pending
    return plain, list(streams), queued


def _first_token_is_whole(usage: dict[str, Any]) -> int:
    """1 when an answer in one piece has a TTFT in the gate's histogram: only with one token or none
    (docs/gate.md, "Answers that are not streamed"); the three streams always have one."""
    return int(usage["output_tokens"] <= 1)


def _held_and_counted(queued: list[float], registry: Any, usages: list[dict[str, Any]]) -> None:
    """Three streams at a limit of 1 queued, and the gate's tokens are the usages the engine reported
    (``input_tokens``/``output_tokens``: the Responses and the Messages APIs name them alike)."""
    assert max(queued) >= 1  # two of the three waited for admission
    tokens = gate_tokens(registry)
    assert tokens == {
        "prompt": sum(u["input_tokens"] for u in usages),
        "output": sum(u["output_tokens"] for u in usages),
    }, (tokens, usages)


async def test_the_responses_api_is_admitted_by_the_gate_and_counted_from_vllms_usage(
    engine: RunningEngine,
) -> None:
    """``POST /v1/responses`` through the gate, streamed and not: held to the in-flight limit like chat,
    and its tokens counted from the ``usage`` vLLM reports (in a stream, in the ``response.completed``
    event, which repeats the whole answer first). Before, the path was passed straight through."""
    body = {"model": "tiny-random-llama", "input": "Say hello", "max_output_tokens": 24}

    async def streamed(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
        async with session.post(url, json={**body, "stream": True}) as r:
            text = await r.text()
        ends = ('"response.completed"', '"response.incomplete"')  # incomplete: max_output_tokens reached
        events = [line for line in text.splitlines() if line.startswith("data:")]
        done = [line for line in events if any(end in line for end in ends)]
        assert len(done) == 1, text[-400:]
        return r.status, json.loads(done[0].removeprefix("data:"))["response"]["usage"]

    async with gate_for(engine.url, **ONE_AT_A_TIME) as (gate, base, registry):
        plain, streams, queued = await _plain_then_streams(
            gate, f"{base}/v1/responses", body, streamed, engine
        )
    assert plain[0] == 200 and plain[1]["status"] in ("completed", "incomplete"), plain
    assert all(status == 200 for status, _ in streams), streams
    usages = [plain[1]["usage"], *(usage for _, usage in streams)]
    assert all(u["output_tokens"] > 0 for u in usages), usages
    _held_and_counted(queued, registry, usages)
    ttft = registry.get_sample_value("servepilot_gate_ttft_seconds_count", {"bucket": "le256"})
    assert ttft == 3 + _first_token_is_whole(plain[1]["usage"])


async def test_the_gates_request_id_is_vllms(engine: RunningEngine) -> None:
    """A request without an ``X-Request-Id`` gets one from the gate (``gate.request_ids``), and vLLM names
    the request by it: its answer's ``id`` is ``cmpl-<id>``, and a client's own id is taken the same way.
    And vLLM's access log names the client the gate appended to ``X-Forwarded-For``, not the gate."""
    body = {"model": "tiny-random-llama", "prompt": "Say hello", "max_tokens": 3}
    async with gate_for(engine.url) as (_, base, _registry), aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v1/completions", json=body) as r:
            given, answer = r.headers["X-Request-Id"], await r.json()
        headers = {"X-Request-Id": "client-7", "X-Forwarded-For": "10.9.8.7"}  # as from an ingress
        async with session.post(f"{base}/v1/completions", json=body, headers=headers) as r:
            own = await r.json()
    assert len(given) == 32 and answer["id"] == f"cmpl-{given}"
    assert own["id"] == "cmpl-client-7"
    await asyncio.sleep(0.5)  # its log line is written after the answer
    assert '10.9.8.7:0 - "POST /v1/completions' in engine.log_tail(200)


async def test_the_gate_counts_streams_from_the_usage_it_asks_vllm_for(engine: RunningEngine) -> None:
    """A chat and a completion stream whose client asked for no usage: the gate asks vLLM for it
    (``gate.stream_usage``) and counts the prompt and output tokens vLLM reports, as a client asking
    directly is told, while its client gets no usage event, as from vLLM directly."""
    chat = {
        "model": "tiny-random-llama",
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 12,
        "stream": True,
        "ignore_eos": True,
    }
    plain = completion("Say hello, and tell me about the weather", 20)
    asks = {"stream_options": {"include_usage": True}}
    requests = [(chat, "/v1/chat/completions"), (plain, "/v1/completions")]
    async with aiohttp.ClientSession() as session:
        direct = [await stream(session, engine.url, {**body, **asks}, path) for body, path in requests]
        async with gate_for(engine.url) as (_, base, registry):
            gated = [await stream(session, base, body, path) for body, path in requests]
    assert [r.status for r in direct + gated] == [200] * 4
    assert all(b'"usage"' not in r.body and r.events[-1] == "[DONE]" for r in gated), gated[0].body[-300:]
    expected = {
        "prompt": float(sum(r.usage["prompt_tokens"] for r in direct)),
        "output": float(sum(r.usage["completion_tokens"] for r in direct)),
    }
    assert expected["output"] == 12 + 20
    assert gate_tokens(registry) == expected


async def test_anthropic_messages_are_admitted_and_every_route_is_judged(engine: RunningEngine) -> None:
    """``POST /v1/messages`` (Anthropic's API, which vLLM serves) through the gate, streamed and not: held
    to the limit, its first token timed at the first ``content_block_delta``, its tokens counted from the
    usage vLLM sends. And this vLLM's whole route list, from its /openapi.json, sorted by the gate's
    rules: every POST route is admitted or known harmless."""
    from agent.engines.launcher import SERVED_MODEL
    from agent.gate.routes import classify

    body = {"model": SERVED_MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello"}]}

    async def streamed(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
        async with session.post(url, json={**body, "stream": True}) as r:
            text = await r.text()
        deltas = [line for line in text.splitlines() if line.startswith("data:") and "message_delta" in line]
        assert 1 <= text.count('"content_block_delta"') <= 8 and deltas, text[-400:]  # 8: unless it ended
        return r.status, json.loads(deltas[-1].removeprefix("data:"))["usage"]

    async with gate_for(engine.url, **ONE_AT_A_TIME) as (gate, base, registry):
        plain, streams, queued = await _plain_then_streams(
            gate, f"{base}/v1/messages", body, streamed, engine
        )
    async with aiohttp.ClientSession() as session, session.get(f"{engine.url}/openapi.json") as r:
        routes = classify(await r.json())
    assert plain[0] == 200 and plain[1]["type"] == "message", plain
    assert all(status == 200 for status, _ in streams), streams
    usages = [plain[1]["usage"], *(usage for _, usage in streams)]
    _held_and_counted(queued, registry, usages)
    ttft = registry.get_sample_value("servepilot_gate_ttft_seconds_count", {"bucket": "le256"})
    assert ttft == 3 + _first_token_is_whole(plain[1]["usage"])
    assert "/v1/messages" in routes.admitted and routes.unjudged == (), routes


async def test_each_sequence_of_a_stream_with_n_2_is_timed_by_its_own_tokens(engine: RunningEngine) -> None:
    """``n`` = 2 streamed through the gate: vLLM interleaves the two sequences' events, and the gate's ITL
    is each sequence's own gaps, as many and as long as the client measures them per ``choices[].index``
    (before 2026-12-04 the gate recorded no ITL for such a stream)."""
    body = completion("Say hello", 16, n=2, temperature=1.0)
    async with gate_for(engine.url) as (_, base, registry), aiohttp.ClientSession() as session:
        result = await stream(session, base, body)
    assert result.status == 200, result.body[-400:]
    expected = result.sequence_gaps()
    assert len(expected) >= 2, result.body[-400:]  # vLLM may send a sequence's tokens in fewer events
    bucket = {"bucket": "le256"}
    assert registry.get_sample_value("servepilot_gate_itl_seconds_count", bucket) == len(expected)
    itl_sum = registry.get_sample_value("servepilot_gate_itl_seconds_sum", bucket)
    # each sequence's own gaps: about twice the gaps between consecutive events (2026-12-04: 0.061-0.083 s
    # against 0.034-0.042 s for 32 tokens; the gate's sum within 1% of the client's)
    assert itl_sum == pytest.approx(sum(expected), rel=0.3, abs=0.01), (itl_sum, expected)


async def _queue_time(session: aiohttp.ClientSession, engine: RunningEngine) -> tuple[float, float]:
    """vLLM's ``vllm:request_queue_time_seconds`` (time its requests waited for the scheduler): sum, count."""
    expo = parse_exposition(await _scrape(session, engine), 0.0, ["vllm:request_queue_time_seconds"])
    series = expo.histograms["vllm:request_queue_time_seconds"]
    return sum(h.sum or 0.0 for h in series), sum(h.count or 0.0 for h in series)


async def test_a_gate_limit_at_max_num_seqs_keeps_requests_for_several_sequences_out_of_vllms_queue(
    engine: RunningEngine,
) -> None:
    """This vLLM runs at most 4 sequences (``max_num_seqs``). With the gate's limit at 4, requests for
    3 and 2 sequences wait at the gate, where its priorities and deadline apply, and not in vLLM's queue:
    the gate counts each sequence. Counted as one request each, they put 10 sequences into a batch of 4,
    and vLLM queued the rest for whole answers (2026-12-04, 160 tokens: 0.37 s a sequence in vLLM's
    queue when counted by request, 0.00 s counted by sequence)."""
    bodies = [completion(f"sequences {i}", 160, n=3 - i % 2, temperature=1.0) for i in range(4)]
    async with (
        gate_for(engine.url, max_in_flight=4, high_reserved_ratio=0.0) as (gate, base, _),
        aiohttp.ClientSession() as session,
    ):
        before = await _queue_time(session, engine)
        results = await stream_many(session, base, bodies)
        after = await _queue_time(session, engine)
    assert [r.status for r in results] == [200] * 4, [r.body[-200:] for r in results]
    waited, sequences = after[0] - before[0], after[1] - before[1]
    assert sequences == 3 + 2 + 3 + 2
    assert waited / sequences < 0.1, (waited, sequences)  # a scheduler step or two, not an answer
    assert gate.admission.in_flight == 0


# --- capability discovery and the sleep lever ---------------------------------------------------------


async def test_discovery_finds_the_runtime_endpoints_this_vllm_serves(engine: RunningEngine) -> None:
    async with aiohttp.ClientSession() as session:
        # vLLM's CPU backend on a 2-core machine pauses for seconds (up to 7.8 s seen): not the 2 s default
        adapter = VllmAdapter(session, engine.url, timeout_s=10.0)
        capabilities = await adapter.discover()
        async with session.get(engine.url + "/openapi.json") as resp:
            paths = set((await resp.json())["paths"])
        async with session.post(engine.url + "/reset_prefix_cache") as resp:
            reset = resp.status
    assert set(capabilities.knobs) == {"paused", "sleeping"}
    # offered by this build but not (yet) a knob of the adapter: an action, not a level
    assert "/reset_prefix_cache" in paths and reset == 200


async def test_sleep_lever_holds_requests_until_wake_up(engine: RunningEngine) -> None:
    client = ControlClient(ControlConfig(enabled=True, url=engine.url, adapter="vllm"))
    await client.start()
    async with aiohttp.ClientSession() as session:
        try:
            asleep = await client.apply({"sleeping": True})
            expo = parse_exposition(await _scrape(session, engine), 0.0, ["vllm:engine_sleep_state"])
            state = {dict(g.labels)["sleep_state"]: g.value for g in expo.gauges["vllm:engine_sleep_state"]}
            pending = asyncio.create_task(stream_many(session, engine.url, [completion("while asleep", 8)]))
            done, _ = await asyncio.wait({pending}, timeout=2.0)
            held = not done
            awake = await client.apply({"sleeping": False})
            results = await asyncio.wait_for(pending, timeout=60)
        finally:
            await client.apply({"sleeping": False})
            await client.close()
    assert asleep.ok and asleep.read_back["sleeping"] is True
    assert state["weights_offloaded"] == 1 and state["awake"] == 0  # the engine's own metric follows
    assert held, "a completion finished while the engine slept"
    assert awake.ok and awake.read_back["sleeping"] is False
    assert results[0].status == 200 and results[0].text


# --- the auto policy against the best static limit ---------------------------------------------------


async def _engine_itl(engine: RunningEngine) -> float:
    """The engine's own mean inter-token latency at 4 concurrent streams (its ITL histogram)."""
    collector = EngineMetricsCollector(EngineConfig(url=engine.url, kind="vllm", quantile_window_s=3600))
    async with aiohttp.ClientSession() as session:
        await collector.collect(0.0)
        await stream_many(session, engine.url, [completion(f"itl {i}", 48) for i in range(4)])
        itl = (await collector.collect(1.0)).values["engine.itl_seconds.mean"]
    await collector.close()
    return itl


CALIBRATIONS = 3
"""Rounds of (ITL alone, capacity) the SLO and the load are taken from, as medians: one round caught the
shared machine at a fast or a slow moment, and a 2x swing either way left the sweep telling no limit from
another (2026-12-02: 6.0 ms ITL and 458 tok/s on one round, 2.2 ms and 814 tok/s on a run 20 minutes
before; every limit, 1 included, then met the too loose SLO for 100% of requests)."""


async def _calibrate(engine: RunningEngine) -> tuple[float, float, str]:
    """Median ITL alone (s) and median capacity (tok/s) over :data:`CALIBRATIONS` rounds, and the rounds."""
    shape = scaled_trace(1.0, 1.0, 1e9)[:64]
    rounds = [(await _engine_itl(engine), await capacity(engine.url, shape)) for _ in range(CALIBRATIONS)]
    shown = ", ".join(f"{itl * 1000:.1f} ms / {tps:.0f} tok/s" for itl, tps in rounds)
    return statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds), shown


def _tells_apart(sweep: list[RunResult]) -> bool | None:
    """Whether the sweep (limits in ascending order) tells the limits apart: True when at least two
    limits serve 90% of requests within the SLO and the smallest, the starved one, does not; False when
    fewer than two do (the load is past the engine); None when the smallest does too (the load is too
    light to matter: 2026-12-02, limit 1 at 100% and limit 2 at 79% in one sweep, which is noise)."""
    met = [r.attainment >= 0.9 for r in sweep]
    return False if sum(met) < 2 else None if met[0] else True


# Timing-sensitive on 2 shared cores (real engine, wall-clock load): one rerun, reported by pytest as
# "rerun", never hidden; a real regression fails both attempts.
@pytest.mark.flaky(reruns=1)
async def test_auto_policy_settles_within_15_percent_of_the_best_static_limit(
    engine: RunningEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    itl, tps, calibration = await _calibrate(engine)
    # The engine's ITL is measured alone; during a replay the load generator, the gate and the collectors
    # share its 2 cores, so a per-token allowance of 4x that left no setting inside the SLO in CI. 8x keeps
    # the SLO reachable for the right limits and out of reach for the starved ones (1, 2).
    slo = Slo(ttft_s=2.0, itl_s=8.0 * itl)
    # The first 20 s are the auto policy's time to settle. It starts at a limit of 1 (the hardest start,
    # not the sidecar's: that starts at policies.initial_batch) and needs a few ticks of token data
    # before it grows; with 10 s the backlog of that ramp still spilled into the window on 2 shared
    # cores (2026-11-30: first attempts failed with auto already at the best static limit, 8, from
    # tick 10 on, both at this code and at the previous session's).
    window = (20.0, 40.0)
    limits = (1, 2, 4, 8, 16)
    # Capacity is measured closed loop (always 8 busy); the trace's bursts queue at far less. The replay
    # runs at 0.35 of it: on quiet runs and in CI that told the starved limits from the rest (limits 1
    # and 2 met the SLO for 48-50% of requests, 4-16 for 99-100%), while 0.5 put the load past the
    # engine whenever the shared machine slowed by 2x for a while (3d1115c's CI run: static 16 met the
    # SLO for 100% of requests, then for 1% on its run again). A sweep that tells no limit apart is run
    # again: at 0.25 when the load is past the engine (fewer than two limits serve 90%), and at 0.5,
    # 0.7, then 1.0, while even limit 1 does; a heavier load past the engine returns to the sweep before
    # it. The steps span the 4x by which the calibration's capacity varies on this machine: 2026-12-02,
    # 319-1330 tok/s, lower in the full suite than alone; at a median of 336 limit 1 still served 100%
    # at 0.7, and at one of 567 every limit served 97-100% at 0.35 and 0.5. The table says which load
    # was used; its last column, the engine's own mean ITL over each run, shows a swing of the machine.
    sweeps: dict[float, list[RunResult]] = {}

    async def sweep_at(load: float) -> list[RunResult]:
        trace = scaled_trace(tps, load=load, seconds=40.0)
        sweeps[load] = [
            await replay(engine.url, trace, slo, limit=n, window=window, name=f"static {n} at {load}")
            for n in limits
        ]
        return sweeps[load]

    load = 0.35
    verdict = _tells_apart(await sweep_at(load))
    if verdict is False:
        load = 0.25
        await sweep_at(load)
    for heavier in (0.5, 0.7, 1.0):
        if verdict is not None:  # it tells the limits apart, or the load is past the engine
            break
        verdict = _tells_apart(await sweep_at(heavier))
        if verdict is not False:
            load = heavier
    sweep, trace = sweeps[load], scaled_trace(tps, load=load, seconds=40.0)
    # The best limit in hindsight; of those within 1% of it, the largest: the one with the most headroom,
    # so its run again is the least likely to tip into a backlog (2026-12-02: limits 2, 4 and 16 all
    # served 100% at 0.5; 2, the first, was picked and served 0% on its run again minutes later).
    top = max(r.goodput_tps for r in sweep)
    best_limit = max(n for n, r in zip(limits, sweep, strict=True) if r.goodput_tps >= 0.99 * top)
    auto = AutoBatch(slo.ttft_s, slo.itl_s, lower=1, upper=16, initial=1)
    result = await replay(engine.url, trace, slo, limit=1, window=window, policy=auto, name=f"auto at {load}")
    # The sweep picks the best limit; auto is compared with that limit measured again right after it.
    # The sweep's own best run is the maximum of five noisy runs, biased upwards by the noise (on 2 shared
    # cores one static row measured 98% within the SLO in one run and 14% in the next), while auto is a
    # single run: that comparison failed first attempts with auto already at the best limit.
    best = await replay(
        engine.url, trace, slo, limit=best_limit, window=window, name=f"static {best_limit} again at {load}"
    )
    table = "\n".join(
        [
            f"capacity {tps:.0f} tok/s (trace-shaped), load {load} of it, engine ITL {itl * 1000:.1f} ms, "
            f"{len(trace)} requests (medians of ITL alone / capacity: {calibration}; sweeps run at loads "
            f"{', '.join(map(str, sweeps))})",
            "| run | goodput tok/s | throughput tok/s | SLO met | requests | final limit | engine ITL ms |",
            "|---|---|---|---|---|---|---|",
            *(r.row() for other in sweeps.values() if other is not sweep for r in other),  # the other load's
            *(r.row() for r in [*sweep, result, best]),
            f"auto limits per tick: {result.limits}",
            "auto's control ticks (its inputs, then its proposal or hold):",
            *result.ticks,
        ]
    )
    # Straight to the terminal, past capture: a failed first attempt that passes on its rerun shows only
    # its first line in the summary, and the table is what says why it failed (which row fell short).
    with capsys.disabled():
        print("\n" + table, flush=True)
    assert max(r.goodput_tps for r in sweep) > 0, table
    assert best.goodput_tps > 0, table
    assert result.goodput_tps >= 0.85 * best.goodput_tps, table


# --- the precision canary's perplexity gate on a real engine -------------------------------------------


async def test_perplexity_through_echo_and_prompt_logprobs_is_finite_and_repeatable(
    engine: RunningEngine,
) -> None:
    import math

    from agent.perplexity import measure

    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Perplexity is the exponential of the mean negative log-likelihood per token.",
    ]
    async with aiohttp.ClientSession() as session:
        first = await measure(session, "primary", engine.url, texts, concurrency=1, timeout_s=120)
        second = await measure(session, "primary", engine.url, texts, concurrency=1, timeout_s=120)
    assert first.model == "tiny-random-llama"  # asked of /v1/models
    assert first.tokens >= 20  # real tokenizer: every prompt token after the first is scored
    assert math.isfinite(first.ppl) and first.ppl > 1.0
    assert second.ppl == pytest.approx(first.ppl, rel=1e-4)  # temperature 0, same prompts: same scores


# --- a hung engine core: /health answers, the stall detector does not wait for it ---------------------


def _urgent() -> list[str]:
    """A prefix that runs a command ahead of CPU-bound processes: ``chrt -f 50`` (real-time FIFO) where
    this user may (root with CAP_SYS_NICE), else none."""
    import shutil
    import subprocess

    prefix = ["chrt", "-f", "50"]
    if shutil.which("chrt") and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
        return prefix
    return []


def _engine_core(parent: int) -> int:
    """The pid of vLLM's ``VLLM::EngineCore`` child process (V1 runs the engine apart from the server)."""
    from pathlib import Path

    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().split()[3])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and cmdline.startswith(b"VLLM::EngineCore"):
            return int(proc.name)
    raise AssertionError(f"no VLLM::EngineCore child of {parent}")


PROGRESS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total")
"""vLLM counters that move while it works (what the engine_stall detector takes for progress)."""


async def _until_quiet(session: aiohttp.ClientSession, engine: RunningEngine, within_s: float = 4.0) -> None:
    """Until two scrapes 0.5 s apart show the same :data:`PROGRESS` counters, for at most ``within_s``
    (well inside the gate's ``EJECT_S``, which must not pass before the test looks at the detector)."""

    async def progress() -> tuple[float, ...]:
        expo = parse_exposition(await _scrape(session, engine), 0.0, PROGRESS)
        return tuple(sum(c.value for c in expo.counters.get(name, ())) for name in PROGRESS)

    deadline = time.monotonic() + within_s
    last = await progress()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = await progress()
        if now == last:
            return
        last = now


async def _engine_holds(session: aiohttp.ClientSession, engine: RunningEngine) -> tuple[float, float]:
    """(running, waiting) as vLLM's own metrics read now."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    expo = parse_exposition(await _scrape(session, engine), 0.0, names)
    running, waiting = (sum(g.value for g in expo.gauges.get(name, ())) for name in names)
    return running, waiting


def _tick_reading(snapshot: Any, stall: Any, t: float, wall_s: float) -> str:
    """One tick as the stall detector saw it: held requests, the progress signals, its mark."""
    from detectors.stall import HELD, PROGRESS_GAUGES, PROGRESS_RATES

    if snapshot is None:
        return f"{wall_s:.1f}s: no snapshot"
    names = (*HELD, *PROGRESS_RATES, *PROGRESS_GAUGES)
    values = {name.removeprefix("engine."): snapshot.get(name) for name in names}
    mark = None if stall.last_progress_ is None else stall.last_progress_ - t
    return f"{wall_s:.1f}s wall: now t+{snapshot.now - t:.0f}, mark t+{mark}, {values}"


# Wall-clock on 2 shared cores: the machine itself stopped for up to 5.9 s here under this engine, and
# its streams for up to 2.8 s more (EJECT_S). One rerun, reported by pytest as "rerun", never hidden.
@pytest.mark.flaky(reruns=1)
async def test_a_stopped_engine_core_is_a_stall_while_health_answers(
    engine: RunningEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGSTOP on the engine-core process is a hang the way a collective that never returns is one: the
    API server keeps answering /health and /metrics (frozen), and the engine_stall detector finds it once
    60 s of ticks (virtual time) pass with requests held; SIGCONT, and it clears once vLLM moves again.

    The requests go through the gate, with a simulator as the weight-0 ``small`` upstream: the gate takes
    the hung vLLM out of the split though its /health answers, ends the frozen running streams with an
    error event rather than leaving them to ``read_timeout_s``, sends the waiting ones (no byte yet) to
    ``small``, which answers them and a new request, and vLLM is back in the split after its hold once
    it answers again."""
    import os
    import signal

    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from agent.config import GateConfig
    from agent.gate.proxy import Gate
    from agent.loop import Loop
    from agent.store import Store
    from detectors.stall import EngineStallDetector
    from simulator.engine import make_core
    from simulator.server import SimServer

    core = _engine_core(engine.proc.pid)
    stall = EngineStallDetector()
    collector = EngineMetricsCollector(EngineConfig(url=engine.url, kind="vllm", timeout_s=5.0))
    loop = Loop([collector], Store(100, 4096), interval_s=1.0, source_timeout_s=5.0, detectors=[stall])
    small = SimServer(make_core("h100-sxm", "llama-2-7b", "fp16", 64), speed=10.0)
    small_runner = web.AppRunner(small.app())
    await small_runner.setup()
    await web.TCPSite(small_runner, "127.0.0.1", 0).start()
    gate_cfg = GateConfig(
        enabled=True,
        upstreams={"primary": engine.url, "small": f"http://127.0.0.1:{small_runner.addresses[0][1]}"},
        split={"primary": 1.0},
        upstream_models={"small": small.core.model.served_name},
        # a hang is 8 s without a byte. Not less: on a 2-core VM this engine's streams went silent for
        # up to 7.8 s with nothing hung, while the whole machine stopped scheduling for up to 5.9 s
        # (the gate does not count its own blind spots, but the engine took up to 2.8 s more to resume)
        eject_stalled_s=EJECT_S,
        health_interval_s=0.5,
        read_timeout_s=60.0,  # a stream the gate failed to end costs a minute, not five
    )
    gate = Gate(gate_cfg, CollectorRegistry())
    via_gate = f"http://127.0.0.1:{await gate.start('127.0.0.1', 0)}"
    primary = gate.pool.upstreams["primary"]
    t = 900.0

    async def tick_until(ready: Callable[[Any], bool], what: str) -> None:
        """Ticks (virtual time, 1 s apart) until ``ready(snapshot)``; fails, saying what, after 30 s."""
        nonlocal t
        seen: list[tuple[float | None, float | None]] = []
        for _ in range(300):
            t += 1.0
            snapshot = (await loop.tick(t)).snapshot
            if snapshot is not None and ready(snapshot):
                return
            if snapshot is not None:
                now = (snapshot.get("engine.requests_running"), snapshot.get("engine.requests_waiting"))
                if not seen or seen[-1] != now:
                    seen.append(now)
            await asyncio.sleep(0.1)
        raise AssertionError(
            f"vLLM never got there: {what}; (running, waiting) seen: {seen}; the gate holds "
            f"{gate_holds()} at vLLM, primary healthy {primary.healthy} ({primary.last_error!r}); "
            f"the requests sent: {answers()}"
        )

    sent: list[asyncio.Future[Any]] = []

    def answers() -> str:
        """What became of the requests sent so far: still streaming, or each answer's status and start
        (a CI run saw them all gone within seconds, the gate holding none and vLLM running none)."""
        said = []
        for future in sent:
            if not future.done():
                said.append("streaming")
            elif future.exception() is not None:
                said.append(f"raised {future.exception()!r}")
            else:
                said.extend(f"{r.status} {r.body[:160]!r} in {r.e2e_s:.1f} s" for r in future.result())
        return "; ".join(said) or "none"

    def engine_holds(snapshot: Any, running: int, waiting: int) -> bool:
        """``running`` requests run and at least ``waiting`` wait (under CPU contention vLLM's API server
        can take seconds to hand a request to the engine core; one waiting is enough)."""
        return (
            snapshot.get("engine.requests_running") == running
            and (snapshot.get("engine.requests_waiting") or 0) >= waiting
        )

    def gate_holds() -> int:
        return sum(1 for name, _, _ in gate.held.at_upstream.values() if name == "primary")

    def gate_unstarted() -> int:
        return gate.held.unanswered("primary")

    async def gate_sees(held: int, unstarted: int, failure: str, while_: asyncio.Future[Any]) -> None:
        """Polls (real time, 30 s) until the gate holds ``held`` requests at vLLM, ``unstarted`` of them
        with no byte yet; fails with ``failure`` and what it saw, at once when ``while_`` (the long
        answers) is over, since the moment can no longer come."""
        for _ in range(600):
            if gate_holds() == held and gate_unstarted() == unstarted:
                return
            if while_.done():
                break
            await asyncio.sleep(0.05)
        raise AssertionError(
            f"{failure}: the gate holds {gate_holds()} at vLLM, {gate_unstarted()} with no byte yet; "
            f"the requests sent: {answers()}"
        )

    urgent = _urgent()

    async def run_a_slice() -> None:
        """SIGCONT, :data:`SLICE_S`, SIGSTOP, by a shell of its own, real-time where allowed
        (:func:`_urgent`). Timed in this process (an ``asyncio.sleep``, or a thread, which needs the GIL
        back from the event loop relaying vLLM's answers), and even by a plain shell, the stop came
        seconds late beside two CPU-bound processes: the continued engine core and its worker took the
        CPUs, and the core finished all four long answers in one "0.05 s" slice (a CI run, 2026-12-05;
        here the plain shell's slices measured 5.3 and 5.6 s, with ``chrt -f 50`` 0.052 s each)."""
        shell = await asyncio.create_subprocess_exec(
            *urgent, "sh", "-c", f"kill -CONT {core}; sleep {SLICE_S}; kill -STOP {core}"
        )
        assert await shell.wait() == 0, "the slice's shell failed"

    async def run_until_started(while_: asyncio.Future[Any]) -> None:
        """A slice of core time (:func:`run_a_slice`), and again, until the gate holds the four long
        requests at vLLM, each with a byte of its answer (a slice is ~1% of the core time they take; a
        slice and the relaying after it, ``QUIET_S`` or more, well inside ``EJECT_S`` of silence); fails
        with what it saw once one ended first."""
        for _ in range(80):
            await run_a_slice()
            # the API server relays what the core made before the stop: wait until the gate's count of
            # answers without a byte holds still for QUIET_S, not a fixed second. With two CPU-bound
            # processes beside a CI run (2026-12-05), relaying took longer than that second, further
            # slices ran, and the core finished all four answers before the gate saw each one's first byte
            last, still_since = gate_unstarted(), time.monotonic()
            while time.monotonic() - still_since < QUIET_S:
                if gate_holds() == 4 and gate_unstarted() == 0:
                    return
                if gate_holds() < 4 or while_.done():
                    raise AssertionError(
                        f"a long answer ended before all four started: the gate holds {gate_holds()} at "
                        f"vLLM, {gate_unstarted()} with no byte yet; the requests sent: {answers()}"
                    )
                await asyncio.sleep(0.05)
                if gate_unstarted() != last:
                    last, still_since = gate_unstarted(), time.monotonic()
        raise AssertionError(f"vLLM made no first tokens in 80 slices; the requests sent: {answers()}")

    async def gate_back() -> None:
        """Until vLLM is in the gate's split again (a missed try may have left it out for its hold)."""
        for _ in range(int((EJECT_S + 10.0) / 0.05)):
            if primary.healthy:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"vLLM never came back into the gate's split: {primary.last_error!r}")

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            # four long answers fill max_num_seqs and run; two short ones wait behind them: the stop must find
            # both kinds at the engine. The four are sent to a stopped engine core, which then runs in
            # slices until each has sent a byte, a state that holds still while it is stopped; the short
            # ones are sent then. Sent to a running core, the API server (which shares 2 cores with it)
            # handed them over seconds apart: in CI (2026-12-05) one long answer never overlapped the
            # other three in three tries, and on 2026-12-02 the short ones came when the long ones were
            # all but over. Sent all six to the stopped core, with two CPU-bound processes beside it the
            # short ones reached it before two of the long ones. That is the set-up, not what is tested,
            # so it has three tries, each printed.
            for attempt in range(1, 4):
                await tick_until(lambda s: engine_holds(s, 0, 0), "idle")  # the detector's first reading
                await gate_back()
                os.kill(core, signal.SIGSTOP)
                running = asyncio.ensure_future(
                    stream_many(session, via_gate, [completion(f"stall {i}", 1800) for i in range(4)])
                )
                sent.append(running)
                try:
                    await gate_sees(4, 4, "the four long requests never reached vLLM", running)
                    await run_until_started(running)
                    stopped_at = gate.clock()
                    waiting = asyncio.ensure_future(
                        stream_many(session, via_gate, [completion(f"wait {i}", 16) for i in range(2)])
                    )
                    sent.append(waiting)
                    await gate_sees(6, 2, "the short requests never reached vLLM", running)
                    # a step that was running ends, and the API server hands out what the engine core had
                    # sent before the stop; only then is nothing moving. On 2 shared cores that took more
                    # than the 0.5 s this waited before: counters moved at a later (virtual) tick and the
                    # stall was found after the last one looked at
                    await _until_quiet(session, engine)
                    # the engine's own frozen view must hold the four: the gate's view is not enough. In
                    # CI (2026-12-04) the engine core had finished all four 1800-token answers (7200
                    # tokens in the tick before the stop) while the gate, relaying them more slowly than
                    # vLLM made them, still held them all, and vLLM read 0 running and 0 waiting
                    held = await _engine_holds(session, engine)
                    if held[0] != 4:
                        raise AssertionError(f"vLLM stopped holding (running, waiting) {held}, not 4 running")
                    break
                except AssertionError as missed:
                    os.kill(core, signal.SIGCONT)  # if it was stopped; harmless if not
                    if attempt == 3:
                        raise
                    with capsys.disabled():  # straight to the terminal, past capture
                        print(f"\nset-up try {attempt} of 3 missed its moment: {missed}", flush=True)
                    await asyncio.wait_for(asyncio.gather(*sent), 120)
            try:
                # ticks 10 s apart (virtual) until the verdict, for at most 160 s. Where the last
                # progress fell is read from the engine, not assumed: a CI run (2026-12-04) found no
                # stall by t + 71 in two tries, so each tick's reading goes into the failure message
                seen_ticks = []
                found = []
                for second in range(1, 161, 10):
                    state = await loop.tick(t + second)
                    seen_ticks.append(_tick_reading(state.snapshot, stall, t, gate.clock() - stopped_at))
                    found = [f for f in state.findings if f.detector == "engine_stall"]
                    if found:
                        break
                found_at = second
                async with session.get(engine.url + "/health") as response:
                    health = response.status
                # EJECT_S of silence, then a health round. The silence counts from the stop or from the
                # gate's last blind spot (its event loop held up 1 s or more), whichever came later: on 2
                # shared cores a hiccup after the stop rightly restarts it, so the wait follows it (30 s
                # at most) rather than failing a gate that did what it should
                while primary.healthy and gate.clock() - stopped_at < 30.0:
                    if gate.clock() - max(stopped_at, gate._awake_since()) > EJECT_S + 5.0:
                        break
                    await asyncio.sleep(0.05)
                assert not primary.healthy, (
                    f"the gate never took the hung vLLM out: {gate.clock() - stopped_at:.1f} s after the "
                    f"stop, last blind spot {stopped_at - gate._awake_since():.1f} s before it, the gate "
                    f"holds {gate_holds()} at vLLM ({gate_unstarted()} with no byte yet), primary "
                    f"{primary.last_error!r}; the requests sent: {answers()}"
                )
                why = primary.last_error
                await asyncio.sleep(1.0)  # health rounds pass while it stays hung: it stays out
                still_out = not primary.healthy
                async with session.post(via_gate + "/v1/completions", json=completion("meanwhile", 4)) as r:
                    meanwhile = (r.status, await r.text())
                for _ in range(200):  # ended or sent elsewhere with the proof, a health round ago
                    if all(name != "primary" for name, _, _ in gate.held.at_upstream.values()):
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)
                # the streams the gate ended are not progress: the engine is still found hung
                state = await loop.tick(t + found_at + 10.0)
                still_stalled = any(f.detector == "engine_stall" for f in state.findings)
            finally:
                os.kill(core, signal.SIGCONT)
            assert health == 200  # what a health check sees of a hung engine
            # found at the first tick 60 s after the last progress, and not before (the loop stopped at the
            # first verdict). When the last progress falls is the engine's: ticks 10 s apart (virtual) come
            # a fraction of a second apart (real), so a counter the API server moves a second late moves
            # several ticks late
            assert found, "\n".join(seen_ticks)
            assert 60.0 <= found_at - (found[0].since - t) < 70.0, "\n".join(seen_ticks)
            assert still_out and why.startswith("stalled: 6 streaming request(s) held"), why
            assert meanwhile[0] == 200 and small.core.model.served_name in meanwhile[1], meanwhile
            assert still_stalled
            cut = await asyncio.wait_for(running, 60)
            finished = await asyncio.wait_for(waiting, 120)
            assert all(r.status == 200 for r in cut + finished)
            # the running streams (tokens came, then none) were ended by the gate rather than left to hang;
            # the waiting ones (no byte yet) were answered by ``small``, their clients none the wiser
            assert all(r.events[-1] == "[DONE]" for r in finished), [r.events[-1] for r in finished]
            served = {json.loads(r.events[0])["model"] for r in finished}
            assert served == {small.core.model.served_name}, served
            for r in cut:
                assert json.loads(r.events[-1])["error"]["code"] == "upstream_stalled", r.events[-1]
                assert "choices" in json.loads(r.events[0])  # it had started: a token came first
            # vLLM runs again: a step, or dropping what the gate let go
            for second in range(found_at + 20, found_at + 80):
                await asyncio.sleep(0.5)
                state = await loop.tick(t + second)
                if not [f for f in state.findings if f.detector == "engine_stall"]:
                    break
            assert not [f for f in state.findings if f.detector == "engine_stall"], "still stalled 30 s on"
            for _ in range(int((EJECT_S + 5.0) / 0.05)):  # out EJECT_S more once it held nothing
                if primary.healthy:
                    break
                await asyncio.sleep(0.05)
            assert primary.healthy
            async with session.post(via_gate + "/v1/completions", json=completion("after", 4)) as r:
                assert r.status == 200 and "tiny-random-llama" in await r.text()  # vLLM answers again
    finally:  # what is still running ends with the session; the rest is ours to stop
        await collector.close()
        await gate.stop()
        await small_runner.cleanup()


@pytest.mark.flaky(reruns=1)
async def test_an_engine_core_hung_while_idle_is_a_stall_through_what_waits_at_its_door(
    engine: RunningEngine,
) -> None:
    """vLLM's engine core stopped (SIGSTOP) while idle, then two requests sent through the gate: they wait
    in vLLM's API server, which counts only what its engine core has, so vLLM reads 0 running and 0
    waiting, frozen. The engine_stall detector finds the hang through the gate's view (requests sent to
    this pod's engine with no byte back, ``gate.engine_unanswered``) at the first tick 60 s after the
    last progress; both requests are answered once the core runs again."""
    import os
    import signal

    from prometheus_client import CollectorRegistry

    from agent.config import GateConfig
    from agent.gate.collector import GateCollector
    from agent.loop import Loop
    from agent.store import Store
    from detectors.stall import ENGINE_UNANSWERED, EngineStallDetector

    core = _engine_core(engine.proc.pid)
    # eject_stalled_s 0: the gate keeps vLLM in its split, so what is tested is the detector's verdict
    gate_cfg = GateConfig(enabled=True, upstreams={"primary": engine.url}, eject_stalled_s=0.0)
    gate = Gate(gate_cfg, CollectorRegistry())
    via_gate = f"http://127.0.0.1:{await gate.start('127.0.0.1', 0)}"
    gate.mark_engine("primary")
    collector = EngineMetricsCollector(EngineConfig(url=engine.url, kind="vllm", timeout_s=5.0))
    loop = Loop(
        [collector, GateCollector(gate)],
        Store(100, 4096),
        interval_s=1.0,
        source_timeout_s=5.0,
        detectors=[EngineStallDetector()],
    )
    t = 500.0
    seen: list[str] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            for second in range(3):  # idle readings: the detector's mark, the collector's rates
                await loop.tick(t + second)
            t += 2.0
            os.kill(core, signal.SIGSTOP)
            try:
                sent = asyncio.ensure_future(
                    stream_many(session, via_gate, [completion(f"door {i}", 4) for i in range(2)])
                )
                for _ in range(600):  # real time, 30 s at most: both at vLLM's door, no byte back
                    if gate.held.unanswered("primary") == 2:
                        break
                    await asyncio.sleep(0.05)
                held = await _engine_holds(session, engine)
                found = []
                for second in range(1, 161, 10):
                    state = await loop.tick(t + second)
                    snapshot = state.snapshot
                    unanswered = None if snapshot is None else snapshot.get(ENGINE_UNANSWERED)
                    seen.append(f"t+{second}: gate unanswered {unanswered}")
                    found = [f for f in state.findings if f.detector == "engine_stall"]
                    if found:
                        break
                found_at = second
            finally:
                os.kill(core, signal.SIGCONT)
            answers = await asyncio.wait_for(sent, 120)
    finally:
        await collector.close()
        await gate.stop()
    assert held == (0.0, 0.0), held  # vLLM's own view: nothing held
    assert found, seen
    assert found[0].evidence["requests_held"] == 2
    assert 60.0 <= found_at - (found[0].since - t) < 70.0, (found_at, found[0].since - t)
    assert [a.status for a in answers] == [200, 200]  # vLLM answers them once it runs again

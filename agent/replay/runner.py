"""Build and run replays from a :class:`ReplaySpec`: one policy, or the sweep of static settings.

Policies: ``auto`` (SLO-aware batch + token budget + breaker, + energy with ``energy=True``), ``seed``
(the published rule), ``static:N`` (the engine's ``max_num_seqs`` fixed at N, no brain) or
``static:N/T`` (also ``max_num_batched_tokens`` fixed at T). Every run starts from the
engine's default batch and token budget: vLLM V1's defaults for the OpenAI server on that GPU
(:func:`vllm_defaults`) unless the spec overrides them. A spec with a priority mix replays priority
classes (:mod:`agent.replay.classes`): :func:`class_plan` checks its class targets and steering as the
config's ``policies`` section would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.config import build as build_config
from agent.gate.admission import AdmissionQueue, Priority
from agent.replay.brain import Brain, Steering
from agent.replay.classes import CLASSES, ClassPlan
from agent.replay.driver import Controller, FaultEvent, Replay, ReplayRun
from agent.replay.slo import Slo
from agent.replay.summary import summarise
from agent.replay.workload import Workload, load
from policies.registry import build_set, clock_levels, default_arbiter
from simulator.engine import make_core
from simulator.specdec import SpecDecodeConfig

DEFAULT_SLO = Slo(10.0, 0.1)
#: The static settings a sweep replays: every value auto's batch bounds (8 up to the default) can reach.
DEFAULT_STATICS: tuple[int, ...] = (8, 16, 24, 32, 48, 64, 80, 96, 128, 192, 256, 384, 512, 1024)
#: The token budgets a sweep replays besides the engine default: every value auto's token budget
#: controller can reach from a 2048 default (halving / doubling within [1024, 4096]), and 512.
DEFAULT_BUDGETS: tuple[int, ...] = (512, 1024, 2048, 4096)
#: The batch settings each non-default budget is swept with (coarser than DEFAULT_STATICS, to keep a
#: sweep's runtime about 2.5x the batch-only one).
BUDGET_STATICS: tuple[int, ...] = (8, 16, 32, 64, 96, 128, 256)


@dataclass(frozen=True)
class ReplaySpec:
    """Everything that defines a replay except the policy."""

    trace: Path
    gpu: str = "a100-80g"
    model: str = "llama-2-7b"
    slo: Slo = DEFAULT_SLO
    rate_scale: float = 1.0
    lengths: Path | None = None
    seed: int = 0
    duration_s: float | None = None
    start_s: float = 0.0
    default_batch: int | None = None
    max_num_batched_tokens: int | None = None
    energy: bool = False
    clock_floor_share: float = 0.45
    interval_s: float = 1.0
    faults: tuple[FaultEvent, ...] = ()
    #: the gate's queue timeout (``gate.max_queue_wait_s``); None: the TTFT SLO, as docs/gate.md
    #: recommends (a request that waited longer has missed it anyway); ``inf``: no gate timeout
    queue_timeout_s: float | None = None
    #: priority classes: (class, share) pairs; empty: one class, judged by ``slo``
    priority_mix: tuple[tuple[str, float], ...] = ()
    #: a class's own targets (``policies.slo_by_priority``): (class, TTFT or None, ITL or None)
    class_slo: tuple[tuple[str, float | None, float | None], ...] = ()
    #: ``policies.itl_steering``: ``global`` or ``served_classes``; None: the config's default
    #: (``served_classes``, which without a priority mix is ``global``)
    itl_steering: str | None = None
    #: ``policies.served_window_s``: a class steers this long after its last request
    served_window_s: float = 300.0
    #: the auto policies' batch bounds (``policies.batch_min``/``batch_max``); None: 8 up to the larger
    #: of 512 and the engine default
    batch_bounds: tuple[float, float] | None = None
    #: the engine drafts this way (simulator/specdec.py); None: no speculative decoding
    spec_decode: SpecDecodeConfig | None = None
    #: ``policies.error_budget``: what the breaker's burn rates are measured against
    error_budget: float = 0.01

    @property
    def gate_timeout_s(self) -> float:
        return self.slo.ttft_s if self.queue_timeout_s is None else self.queue_timeout_s


def vllm_defaults(gpu: str) -> tuple[int, int]:
    """vLLM V1's ``(max_num_seqs, max_num_batched_tokens)`` for the OpenAI server on ``gpu``: (256, 2048)
    on A100 and smaller GPUs, (1024, 8192) on >= 70 GiB non-A100 GPUs (H100, H200), per
    ``EngineArgs._set_default_args``/``get_batch_defaults`` in vllm/engine/arg_utils.py."""
    return (256, 2048) if gpu.lower().startswith(("a100", "4xa100")) else (1024, 8192)


def parse_policy(text: str) -> tuple[str, int | None]:
    """``auto`` / ``seed`` / ``static:N`` / ``static:N/T`` -> (kind, N); raises ValueError with one line
    (the token budget T: :func:`static_tokens`)."""
    if text in ("auto", "seed"):
        return text, None
    kind, _, raw = text.partition(":")
    seqs, slash, tokens = raw.partition("/")
    if (
        kind == "static"
        and seqs.isdigit()
        and int(seqs) >= 1
        and (not slash or (tokens.isdigit() and int(tokens) >= 16))
    ):
        return "static", int(seqs)
    raise ValueError(
        f"--policy must be auto, seed, static:N or static:N/T with N >= 1 and T >= 16, got {text!r}"
    )


def static_tokens(text: str) -> int | None:
    """The token budget T of ``static:N/T`` (None for any other policy); assumes a valid policy."""
    _, slash, tokens = text.partition("/")
    return int(tokens) if slash else None


def class_plan(spec: ReplaySpec) -> ClassPlan | None:
    """The spec's priority classes, or None without a mix; raises ValueError (one line naming the
    setting) on a bad target or steering, or on class settings without a mix."""
    if not spec.priority_mix:
        if spec.class_slo or spec.itl_steering not in (None, "global"):
            raise ValueError(
                "class targets and ITL steering served_classes need a priority mix (--priority-mix)"
            )
        return None
    own = {
        name: {k: v for k, v in (("ttft_s", ttft), ("itl_s", itl)) if v is not None}
        for name, ttft, itl in spec.class_slo
    }
    section = {
        "ttft_slo_s": spec.slo.ttft_s,
        "itl_slo_s": spec.slo.itl_s,
        "slo_by_priority": own,
        "served_window_s": spec.served_window_s,
    }
    if spec.itl_steering is not None:
        section["itl_steering"] = spec.itl_steering
    policies = build_config({"policies": section}, environ={}).policies
    return ClassPlan(dict(spec.priority_mix), policies)


def gate_for(plan: ClassPlan, limit: int) -> AdmissionQueue:
    """The live gate's admission queue at its config defaults (queue size, high reserve, aging), with
    ``limit`` in flight and each class's deadline scaled by its TTFT target."""
    from agent.config import GateConfig

    defaults = GateConfig()
    gate = AdmissionQueue(
        limit,
        defaults.queue_size,
        high_reserved_ratio=defaults.high_reserved_ratio,
        aging_s=defaults.aging_s,
    )
    for name, scale in zip(CLASSES, plan.wait_scales(), strict=True):
        gate.wait_scale[Priority[name.upper()]] = scale
    return gate


def workload_for(spec: ReplaySpec, max_model_len: int) -> Workload:
    w = load(
        spec.trace,
        rate_scale=spec.rate_scale,
        max_model_len=max_model_len,
        lengths=spec.lengths,
        seed=spec.seed,
    )
    if spec.start_s or spec.duration_s:
        end = spec.start_s + spec.duration_s if spec.duration_s else float("inf")
        return w.between(spec.start_s, end)
    return w


def run_policy(spec: ReplaySpec, policy: str, workload: Workload | None = None) -> tuple[ReplayRun, str]:
    """Replay ``policy`` on ``spec``; returns the run and the policy's display name."""
    kind, n = parse_policy(policy)
    plan = class_plan(spec)
    default_batch, default_tokens = vllm_defaults(spec.gpu)
    default_batch = spec.default_batch or default_batch
    default_tokens = spec.max_num_batched_tokens or default_tokens
    core = make_core(
        spec.gpu,
        spec.model,
        max_num_seqs=n or default_batch,
        max_num_batched_tokens=static_tokens(policy) or default_tokens,
        scheduling_policy="fcfs" if plan is None else "priority",
        spec=spec.spec_decode,
    )
    w = workload if workload is not None else workload_for(spec, core.model.max_model_len)
    controller: Controller | None = None
    name = policy
    last_seen: dict[str, float] = {}
    bounds = spec.batch_bounds or (8.0, float(max(512, default_batch)))
    if kind != "static":
        levels = (
            clock_levels(core.gpu.clock_max_mhz, core.gpu.clock_max_mhz * spec.clock_floor_share)
            if spec.energy and kind == "auto"
            else ()
        )
        policies = build_set(
            kind,
            ttft_slo_s=spec.slo.ttft_s,
            itl_slo_s=spec.slo.itl_s,
            initial_batch=float(default_batch),
            batch_bounds=bounds,
            clock_levels_mhz=levels,
            initial_token_budget=float(default_tokens),
            queue_deadline=spec.gate_timeout_s < math.inf,
            error_budget=spec.error_budget,
        )
        steering = None
        if plan is not None and plan.policies.itl_steering != "global":
            steering = Steering(plan.policies, last_seen, bounds, spec.slo.itl_s)
        controller = Brain(policies, default_arbiter(), interval_s=spec.interval_s, steering=steering)
        if levels:
            name = f"{policy}+energy"
    replay = Replay(
        core,
        w,
        spec.slo,
        controller=controller,
        interval_s=spec.interval_s,
        faults=spec.faults,
        seed=spec.seed,
        queue_timeout_s=spec.gate_timeout_s,
        classes=plan.draw(len(w), spec.seed) if plan is not None else None,
        targets=plan.targets() if plan is not None else (),
        gate=gate_for(plan, n or default_batch) if plan is not None else None,
        last_seen=last_seen,
    )
    return replay.run(), name


def run_summary(
    spec: ReplaySpec, policy: str, *, with_actions: bool = True, workload: Workload | None = None
) -> dict[str, Any]:
    run, name = run_policy(spec, policy, workload)
    return summarise(run, name, with_actions=with_actions)


def engine_default(spec: ReplaySpec) -> str:
    """The static policy that is the engine's default setting on ``spec``'s GPU (or its
    ``default_batch``), at the default token budget: what a deployment without servepilot runs."""
    return f"static:{spec.default_batch or vllm_defaults(spec.gpu)[0]}"


def versus(summary: Mapping[str, Any], best: Mapping[str, Any], default: Mapping[str, Any]) -> dict[str, Any]:
    """``summary``'s goodput as a multiple of the best static setting's and the engine default's (the
    issue's two yardsticks: at least 1x and 1.3x), with the SLO attainment beside them."""

    def ratio(other: Mapping[str, Any]) -> float | None:
        return summary["goodput_tps"] / other["goodput_tps"] if other["goodput_tps"] > 0 else None

    return {
        "best_static": {"policy": best["policy"], "goodput_ratio": ratio(best)},
        "engine_default": {"policy": default["policy"], "goodput_ratio": ratio(default)},
        "slo_attainment": summary["slo_attainment"],
    }


def static_grid(
    spec: ReplaySpec,
    settings: Sequence[int] = DEFAULT_STATICS,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    budget_settings: Sequence[int] = BUDGET_STATICS,
) -> list[str]:
    """The static policies a sweep replays: ``static:N`` for every N in ``settings`` (at the engine's
    default token budget), then ``static:N/T`` for every other budget T in ``budgets`` and N in
    ``budget_settings``."""
    default_tokens = spec.max_num_batched_tokens or vllm_defaults(spec.gpu)[1]
    grid = [f"static:{n}" for n in settings]
    grid += [f"static:{n}/{t}" for t in budgets if t != default_tokens for n in budget_settings]
    return grid


def sweep(
    spec: ReplaySpec,
    settings: Sequence[int] = DEFAULT_STATICS,
    *,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    budget_settings: Sequence[int] = BUDGET_STATICS,
    workload: Workload | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every static setting of :func:`static_grid` (one summary each, without action lists) and the one
    with the best goodput (ties: the higher SLO attainment). ``workload`` saves re-reading the trace for
    each setting; ``budgets=()`` sweeps the batch alone."""
    base = replace(spec, energy=False)
    grid = static_grid(spec, settings, budgets, budget_settings)
    rows = [run_summary(base, policy, with_actions=False, workload=workload) for policy in grid]
    best = max(rows, key=lambda r: (r["goodput_tps"], r["slo_attainment"]))
    return rows, best

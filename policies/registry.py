"""The explicit registry of policies, by name, each with a default on/off, and the policy sets.

Call :func:`register_defaults` once at start-up; importing this module registers nothing. Factories take
no arguments and build a policy with its defaults (an SLO of 2 s TTFT / 100 ms ITL); the agent and
``servepilot replay`` build SLO-specific instances with :func:`build_set`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from policies import base
from policies.arbiter import Arbiter, KnobRule
from policies.base import Policy
from policies.batch_auto import AutoBatch
from policies.batch_seed import SeedBatch
from policies.breaker import Breaker
from policies.canary import Canary
from policies.energy import Energy
from policies.knobs import BATCH, POWER_LIMIT, QUEUE_WAIT, SM_CLOCK, TOKEN_BUDGET
from policies.queue_deadline import QueueDeadline
from policies.schedule import Schedule
from policies.token_budget import TokenBudget

DEFAULT_TTFT_S = 2.0
DEFAULT_ITL_S = 0.1


def _policy(name: str, factory: Callable[[], Policy], default_enabled: bool, description: str) -> None:
    if name not in base.REGISTRY:
        base.register(name, factory, default_enabled=default_enabled, description=description)


def register_defaults() -> None:
    """Register every built-in policy (idempotent)."""
    _policy("breaker", Breaker, True, "multi-level circuit breaker on SLO burn rate, 5xx, preemption, memory")
    _policy("batch_auto", lambda: AutoBatch(DEFAULT_TTFT_S, DEFAULT_ITL_S), True, "SLO-aware batch limit")
    _policy(
        "token_budget",
        lambda: TokenBudget(DEFAULT_TTFT_S, DEFAULT_ITL_S),
        True,
        "chunked-prefill token budget: small chunks when prefill stalls decodes (engines that offer it)",
    )
    _policy("batch_seed", SeedBatch, False, "the published utilisation rule (baseline)")
    _policy("canary", Canary, False, "perplexity-gated, stepped fp8 rollout with rollback")
    _policy(
        "energy",
        lambda: Energy(DEFAULT_TTFT_S, DEFAULT_ITL_S, (1980.0, 1700.0, 1400.0, 1100.0)),
        False,
        "lowest GPU clock that meets the SLO",
    )


def clock_levels(clock_max_mhz: float, clock_floor_mhz: float, count: int = 8) -> tuple[float, ...]:
    """``count`` clocks from ``clock_max_mhz`` down to ``clock_floor_mhz``, evenly spaced, rounded."""
    if count < 1 or clock_floor_mhz > clock_max_mhz:
        raise ValueError("need count >= 1 and floor <= max")
    if count == 1:
        return (float(clock_max_mhz),)
    step = (clock_max_mhz - clock_floor_mhz) / (count - 1)
    return tuple(float(round(clock_max_mhz - i * step)) for i in range(count))


def build_set(
    name: str,
    *,
    ttft_slo_s: float,
    itl_slo_s: float,
    batch_bounds: tuple[float, float] = (8.0, 512.0),
    initial_batch: float = 64.0,
    clock_levels_mhz: tuple[float, ...] = (),
    energy_knob: str = SM_CLOCK,
    schedule: Schedule | None = None,
    breaker: bool = True,
    breaker_levels: tuple[int, ...] = (0, 1, 2, 3),
    breaker_route: str = "primary",
    initial_token_budget: float | None = None,
    queue_deadline: bool = False,
    error_budget: float = 0.01,
) -> list[Policy]:
    """The policies of a named set: ``auto`` (SLO-aware batch + breaker, + the token budget controller
    when ``initial_token_budget`` (the engine's start value) is given, + energy when clock levels are
    given) or ``seed`` (the published rule alone, with its [8, 32] bounds)."""
    if name == "seed":
        return [SeedBatch()]
    if name != "auto":
        raise ValueError(f"unknown policy set {name!r}; known: auto, seed, static:N")
    lower, upper = batch_bounds
    policies: list[Policy] = [
        AutoBatch(ttft_slo_s, itl_slo_s, lower=lower, upper=upper, initial=initial_batch)
    ]
    if initial_token_budget is not None:
        budget = token_budget_policy(ttft_slo_s, itl_slo_s, initial_token_budget)
        if clock_levels_mhz:  # lower clocks lengthen every chunk's step: ITL may take it to the floor
            budget = replace(budget, itl_floor=budget.lower)
        policies.append(budget)
    if queue_deadline:
        policies.append(QueueDeadline(ttft_slo_s))
    if clock_levels_mhz:
        policies.append(Energy(ttft_slo_s, itl_slo_s, clock_levels_mhz, schedule=schedule, knob=energy_knob))
    if breaker:
        policies.append(
            Breaker(
                slo_target=1.0 - error_budget,
                levels=breaker_levels,
                itl_slo_s=itl_slo_s,
                normal_route=breaker_route,
            )
        )
    return policies


def token_budget_policy(ttft_slo_s: float, itl_slo_s: float, initial_token_budget: float) -> TokenBudget:
    """The token budget controller for an engine that starts at ``initial_token_budget``: its default
    range, widened to include the start value (an H100 engine starts at 8192)."""
    budget = TokenBudget(ttft_slo_s, itl_slo_s)
    return TokenBudget(
        ttft_slo_s,
        itl_slo_s,
        lower=min(budget.lower, initial_token_budget),
        upper=max(budget.upper, initial_token_budget),
        initial=initial_token_budget,
    )


def default_arbiter(
    batch_bounds: tuple[float, float] = (1.0, 1024.0), clock_bounds: tuple[float, float] = (0.0, 1e5)
) -> Arbiter:
    """Knob rules: batch moves at most 50% per tick, clocks by any amount (the energy ladder steps), the
    token budget at most x2 or /2 per move within [256, 16384], at most once per 5 s."""
    return Arbiter(
        {
            BATCH: KnobRule(batch_bounds[0], batch_bounds[1], max_step=0.5, integer=True),
            SM_CLOCK: KnobRule(clock_bounds[0], clock_bounds[1], hysteresis=0.0),
            POWER_LIMIT: KnobRule(0.0, 1e5, max_step=0.25, cooldown_s=5.0),
            TOKEN_BUDGET: KnobRule(256.0, 16384.0, max_step=1.0, cooldown_s=5.0, integer=True),
            QUEUE_WAIT: KnobRule(0.1, 3600.0, max_step=0.5, cooldown_s=2.0),
        }
    )


def retune(
    policy: Policy,
    *,
    ttft_slo_s: float,
    itl_slo_s: float,
    batch_bounds: tuple[float, float],
    schedule: Schedule | None,
    error_budget: float | None = None,
) -> Policy:
    """``policy`` with a reloaded config's SLO targets, batch bounds and peak schedule, every other
    parameter as it was: what :func:`build_set` would have given it, less what was learnt at start-up
    (the batch it started from, the engine's token budget). Its state is the loop's, kept under its name,
    so the controller carries on from where it stands rather than from its start value.

    The seed rule keeps its published [8, 32]; a policy without these parameters comes back as it is.
    ``error_budget`` (the breaker's; None keeps it) is the reload's ``policies.error_budget``.
    Raises ValueError when the new values do not fit the policy (the caller then changes nothing)."""
    lower, upper = batch_bounds
    if isinstance(policy, AutoBatch):
        start = min(upper, max(lower, policy.initial))
        return replace(
            policy, ttft_slo_s=ttft_slo_s, itl_slo_s=itl_slo_s, lower=lower, upper=upper, initial=start
        )
    if isinstance(policy, TokenBudget):
        return replace(policy, ttft_slo_s=ttft_slo_s, itl_slo_s=itl_slo_s)
    if isinstance(policy, Energy):
        return replace(policy, ttft_slo_s=ttft_slo_s, itl_slo_s=itl_slo_s, schedule=schedule)
    if isinstance(policy, QueueDeadline):
        return replace(policy, ttft_slo_s=ttft_slo_s)
    if isinstance(policy, Breaker):
        slo_target = policy.slo_target if error_budget is None else 1.0 - error_budget
        itl = policy.itl_slo_s if policy.itl_slo_s is None else itl_slo_s
        if (slo_target, itl) == (policy.slo_target, policy.itl_slo_s):
            return policy
        return replace(policy, slo_target=slo_target, itl_slo_s=itl)
    return policy


def with_batch_bounds(arbiter: Arbiter, batch_bounds: tuple[float, float]) -> Arbiter:
    """``arbiter`` with the batch knob held to ``batch_bounds`` (a reload), its other rules as they were."""
    rule = arbiter.rules.get(BATCH)
    if rule is None:
        return arbiter
    lower, upper = batch_bounds
    return replace(arbiter, rules={**arbiter.rules, BATCH: replace(rule, lower=lower, upper=upper)})

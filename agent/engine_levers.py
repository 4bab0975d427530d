"""The policies that wait for the engine's control API: what it offers is known only after discovery,
which may come minutes after the sidecar starts (an engine still loading its weights), so they join the
running set then (:meth:`agent.sidecar.Sidecar._after_control_discovery`), not at start-up.

Each function returns the policy to add, or None with a log line saying why it stays out; none raises
for an engine that lacks the lever, since observation goes on without it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from agent.assembly import ENERGY_FLOOR_SHARE
from agent.config import Config

if TYPE_CHECKING:
    from agent.knobs import Knobs
    from policies.base import Policy

log = logging.getLogger(__name__)


def engine_energy(cfg: Config, knobs: Knobs) -> Policy | None:
    """``policies.energy`` without a GPU actuator (``actuators.gpu: off``): the ladder drives the engine's
    ``sm_clock_mhz`` where its control API offers it (the simulator's does; agent/knobs.py binds it),
    over the range it publishes."""
    if not cfg.policies.energy or knobs.gpu is not None or cfg.policies.set != "auto":
        return None
    from agent.knobs import ENGINE_CLOCK

    caps = knobs.control.capabilities if knobs.control is not None else None
    spec = caps.knobs.get(ENGINE_CLOCK) if caps is not None else None
    if spec is None or spec.maximum is None:
        log.warning(
            "energy policy off: actuators.gpu is off and the engine's control API offers no %s", ENGINE_CLOCK
        )
        return None
    from policies.energy import Energy
    from policies.registry import clock_levels
    from policies.schedule import Schedule

    p = cfg.policies
    top = float(spec.maximum)
    levels = p.energy_levels or clock_levels(top, max(float(spec.minimum or 0.0), ENERGY_FLOOR_SHARE * top))
    schedule = Schedule.from_data(p.schedule) if p.schedule else None
    log.info("energy policy on the engine's %s: %s MHz", ENGINE_CLOCK, ", ".join(f"{v:g}" for v in levels))
    return Energy(p.ttft_slo_s, p.itl_slo_s, levels, schedule=schedule)


async def token_budget(cfg: Config, knobs: Knobs, policies: list[Policy]) -> Policy | None:
    """When the engine's control API offers the chunked-prefill budget (the simulator does; vLLM and
    SGLang fix ``max_num_batched_tokens`` at start-up), the ``auto`` set gains its controller, around the
    value the engine runs with now. With an energy policy among ``policies`` its ITL floor is its lower
    bound, as the start-up set has it (``policies.registry.build_set``)."""
    from policies import knobs as policy_knobs

    bound = policy_knobs.TOKEN_BUDGET in knobs.actuation.knobs
    if cfg.policies.set != "auto" or not bound or knobs.control is None:
        return None
    try:
        current = (await knobs.control.read()).get(policy_knobs.TOKEN_BUDGET.split(".", 1)[1])
    except Exception as error:  # observation goes on without the lever
        log.warning("token budget controller not started: cannot read the engine's budget: %s", error)
        return None
    if not isinstance(current, int | float) or isinstance(current, bool) or current <= 0:
        return None
    from policies.energy import Energy
    from policies.registry import token_budget_policy

    p = cfg.policies
    budget = token_budget_policy(p.ttft_slo_s, p.itl_slo_s, float(current))
    if any(isinstance(policy, Energy) for policy in policies):
        budget = replace(budget, itl_floor=budget.lower)
    log.info("token budget controller on: the engine runs max_num_batched_tokens=%g", current)
    return budget


async def start_batch_at_the_engines_cap(knobs: Knobs, policies: list[Policy]) -> None:
    """Without a gate the batch knob is the engine's ``max_num_seqs`` (agent/knobs.py), and the auto
    policy must start from the value the engine runs with (vLLM's default is 256), not from
    ``policies.initial_batch``: its first step up from 64 would otherwise cut the engine to 96. Replaces
    the auto policy in ``policies``, in place."""
    from policies import knobs as policy_knobs
    from policies.batch_auto import AutoBatch

    if knobs.gate is not None or policy_knobs.BATCH not in knobs.actuation.knobs:
        return
    read, _ = knobs.actuation.binding(policy_knobs.BATCH)
    try:
        current = float(await read())
    except Exception as error:  # observation goes on; auto keeps policies.initial_batch
        log.warning("cannot read the engine's max_num_seqs: %s", error)
        return
    for i, policy in enumerate(policies):
        if isinstance(policy, AutoBatch):
            start = min(policy.upper, max(policy.lower, current))
            policies[i] = replace(policy, initial=start)
            log.info("auto batch starts at the engine's max_num_seqs=%g", current)


def sleep_wake(cfg: Config, knobs: Knobs) -> Policy | None:
    """``policies.sleep``: the sleep/wake policy, when the engine's control API offers sleep (vLLM serves
    ``/sleep`` and ``/wake_up`` in dev mode)."""
    if not cfg.policies.sleep:
        return None
    from policies.sleep import SLEEPING, SleepWake

    if SLEEPING not in knobs.actuation.knobs:
        log.warning("sleep/wake off: the engine's control API offers no sleep (%s is not bound)", SLEEPING)
        return None
    p, f = cfg.policies, cfg.forecast
    # the horizon the forecaster selects its model at (30 min), when published: the wake-up then starts
    # that long before the forecast rise, more than a reload takes; the top quantile is the upper bound
    horizon = f.selection_horizon_min if f.selection_horizon_min in f.horizons_min else max(f.horizons_min)
    signal = f"forecast.requests_per_second.h{horizon}m.q{max(f.quantiles):g}"
    log.info(
        "sleep/wake on: sleeps after %g s idle while %s < %g", p.sleep_min_idle_s, signal, p.sleep_below_rps
    )
    return SleepWake(p.sleep_below_rps, p.wake_above_rps, p.sleep_min_idle_s, forecast_signal=signal)

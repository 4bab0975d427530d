"""What a config assembles: the collectors, detectors and policies the sidecar runs, and the derived
settings they need (the energy ladder, the breaker's levels, the normal route).

Kept apart from :mod:`agent.sidecar` (the process: start, reload, stop) so the pieces can be built
without a running sidecar: ``servepilot check`` builds the collectors, the benchmarks and fault tests
build the detectors, and replay-style tests build the policy set.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor
from typing import Any

from agent.collectors.base import Collector
from agent.config import Config
from detectors.base import Detector
from policies.base import Policy

log = logging.getLogger(__name__)


def build_collectors(cfg: Config) -> list[Collector]:
    """The collectors the config asks for, in a fixed order. Nothing is faked silently."""
    from agent.collectors.engine_metrics import EngineMetricsCollector

    collectors: list[Collector] = [EngineMetricsCollector(cfg.engine)]
    if cfg.engine.kind == "llamacpp":  # llama.cpp has no KV metric: slot and context use come from /slots
        from agent.collectors.llamacpp_slots import LlamaCppSlotsCollector

        collectors.append(LlamaCppSlotsCollector(cfg.engine))
    if cfg.nvml.backend != "off":
        from agent.collectors.nvml import NvmlCollector

        nvml = NvmlCollector(cfg.nvml)
        nvml.start()
        collectors.append(nvml)
    if cfg.probe.enabled:
        from agent.collectors.probe import ProbeCollector

        collectors.append(ProbeCollector(cfg.probe))
    return collectors


def build_policies(cfg: Config, gpu: Any = None) -> list[Policy]:
    """The configured policy set (``policies.set``); none when it is ``none``. ``gpu`` is the GPU actuator
    (``agent.actuators.gpu.GpuActuator``), whose range gives the energy ladder when none is configured."""
    if cfg.policies.set == "none":
        return []
    from policies import knobs as policy_knobs
    from policies.registry import build_set
    from policies.schedule import Schedule

    p = cfg.policies
    # without a GPU actuator the ladder may drive the engine's clock instead, known after discovery
    levels = energy_ladder(cfg, gpu) if p.energy and cfg.actuators.gpu != "off" else ()
    return build_set(
        p.set,
        ttft_slo_s=p.ttft_slo_s,
        itl_slo_s=p.itl_slo_s,
        batch_bounds=(float(p.batch_min), float(p.batch_max)),
        initial_batch=float(p.initial_batch),
        clock_levels_mhz=levels,
        energy_knob=policy_knobs.GPU_KNOB.get(cfg.actuators.gpu, policy_knobs.SM_CLOCK),
        schedule=Schedule.from_data(p.schedule) if p.schedule else None,
        breaker_levels=breaker_levels(cfg),
        breaker_route=normal_route(cfg),
        queue_deadline=cfg.gate.enabled,  # its knob is the gate's
        error_budget=p.error_budget,
    )


#: Where the derived energy ladder ends, as a share of the GPU's top clock or power limit: the replay's
#: floor (``agent/replay/runner.py``), below which the U-shaped energy per token rises again.
ENERGY_FLOOR_SHARE = 0.45


def energy_ladder(cfg: Config, gpu: Any) -> tuple[float, ...]:
    """``policies.energy_levels``, or 8 steps from the GPU's top (its highest clock, or its default power
    limit) down to 45% of it, never below what the GPU allows; empty, with one error logged, when the GPU's
    range cannot be read: energy stays off."""
    if cfg.policies.energy_levels:
        return cfg.policies.energy_levels
    from policies.registry import clock_levels

    try:
        lo, _ = gpu.bounds()
        top = gpu.top()
    except Exception as error:  # NVML trouble: the sidecar runs on without the energy policy
        log.error("energy policy off: cannot read the GPU's %s range: %s", cfg.actuators.gpu, error)
        return ()
    return clock_levels(top, max(lo, ENERGY_FLOOR_SHARE * top))


def breaker_levels(cfg: Config) -> tuple[int, ...]:
    """The breaker levels this deployment can take: L2 and L3 route the gate's traffic to its ``fp8`` and
    ``small`` upstreams, so each needs that upstream; without a gate only L1 (a smaller batch) is left."""
    from policies.breaker import UPSTREAM_BY_LEVEL

    upstreams = cfg.gate.upstreams if cfg.gate.enabled else {}
    return tuple(level for level, name in enumerate(UPSTREAM_BY_LEVEL) if level <= 1 or name in upstreams)


def normal_route(cfg: Config) -> str:
    """Where the breaker routes at L0 and L1: the one upstream the configured split sends everything to,
    or ``default`` (the configured split itself) when it spreads traffic over several."""
    from policies.knobs import DEFAULT_ROUTE

    carrying = [name for name, weight in cfg.gate.split.items() if weight > 0]
    return carrying[0] if len(carrying) == 1 else DEFAULT_ROUTE


def build_detectors(
    executor: Executor | None = None,
    slo_s: Mapping[str, float] | None = None,
    windows_s: tuple[float, float] | None = None,
    draft_cost_ratio: float | None = None,
    disabled: Iterable[str] = (),
) -> list[Detector]:
    """Every registered detector that is enabled by default. Detectors with periodic heavy refits (an
    ``executor`` attribute) get ``executor`` so the refit runs in a worker thread, not in the tick; those
    that judge latency against the SLO get ``slo_s`` (:func:`set_detector_slo`); those that model latency
    quantiles get the windows (engine, gate) the quantiles are of (``windows_s``: ``set_windows``); the
    speculative-decoding detector gets ``draft_cost_ratio`` (``detectors.spec_draft_cost_ratio``). Those
    named in ``disabled`` (``detectors.disabled``) are left out."""
    from detectors import base, registry

    if not base.REGISTRY:
        registry.register_defaults()
    off = frozenset(disabled)
    detectors = [
        reg.factory() for name, reg in base.REGISTRY.items() if reg.default_enabled and name not in off
    ]
    if executor is not None:
        for detector in detectors:
            if hasattr(detector, "executor"):
                detector.executor = executor
    if slo_s is not None:
        set_detector_slo(detectors, slo_s)
    if windows_s is not None:
        for detector in detectors:
            if hasattr(detector, "set_windows"):
                detector.set_windows(*windows_s)
    if draft_cost_ratio is not None:
        for detector in detectors:
            if hasattr(detector, "draft_cost_ratio"):
                detector.draft_cost_ratio = draft_cost_ratio
    return detectors


def set_detector_slo(detectors: Iterable[Detector], slo_s: Mapping[str, float]) -> None:
    """Hand the latency targets (``{"ttft": s, "itl": s}``) to every detector with an ``slo_s``
    attribute (the tail-latency detector pages only on tails that threaten them); also on a reload."""
    for detector in detectors:
        if hasattr(detector, "slo_s"):
            detector.slo_s = dict(slo_s)


def warm_imports() -> None:
    """Import the heavy modules detectors import on first use (a worker thread's job at start-up).

    Imported later, on first use, they run in the refit thread while ticks run, and an import holds the
    GIL for most of its 0.3-0.7 s: the multivariate detector's first forest fit (after its first 256 rows)
    imported scikit-learn and made the ticks around it the slowest of a 300-tick benchmark (5.0-5.4 ms
    against a 3.4 ms median)."""
    import scipy.stats  # noqa: F401  (detectors/domain_util.py's Theil-Sen slope)

    with contextlib.suppress(ImportError):  # the [ml] extra (without it the forest cannot fit)
        import sklearn.ensemble  # noqa: F401  (detectors/multivariate.py's isolation forest)

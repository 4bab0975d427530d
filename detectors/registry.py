"""The explicit registry of detectors and univariate scorers, by name, each with a default on/off.

Call :func:`register_defaults` once at start-up (the agent, ``servepilot detect`` and the tests do);
importing this module registers nothing. Adding a detector is one line in the list below, keep it a
plain list of calls so parallel additions merge cleanly.
"""

from __future__ import annotations

from collections.abc import Callable

from detectors import base, streaming


def _detector(
    name: str, factory: Callable[[], base.Detector], default_enabled: bool, description: str
) -> None:
    if name not in base.REGISTRY:
        base.register(name, factory, default_enabled=default_enabled, description=description)


def _scorer(
    name: str, factory: Callable[[], streaming.StreamingScorer], default_enabled: bool, description: str
) -> None:
    if name not in streaming.SCORERS:
        streaming.register_scorer(name, factory, default_enabled=default_enabled, description=description)


def _general() -> base.Detector:
    from detectors.general import GeneralAnomalyDetector
    from detectors.novelty import staggered_factory
    from detectors.thresholds import Thresholder

    # k = n = 1: the scorer's rest period already reports one excursion as one high point, so a
    # 2-of-3 persistence rule would never see a second hit. The daily alarm budget still applies.
    # Staggered re-cut phases: ~80 signals' O(history) range checks would otherwise share one tick.
    return GeneralAnomalyDetector(staggered_factory(), lambda: Thresholder(threshold=0.9, k=1, n=1))


def _ensemble() -> streaming.StreamingScorer:
    from detectors.ensemble import EnsembleScorer

    return EnsembleScorer()


def _novelty() -> streaming.StreamingScorer:
    from detectors.novelty import LevelNoveltyScorer

    return LevelNoveltyScorer()


def _robust_z() -> streaming.StreamingScorer:
    from detectors.robust_z import RobustZScorer

    return RobustZScorer()


#: The scorer ``servepilot detect`` uses when no ``--detector`` is given.
DEFAULT_SCORER = "novelty"


def register_defaults() -> None:
    """Register every built-in detector and scorer. Idempotent."""
    # Univariate streaming scorers (the contract test runs over every one of these).
    _scorer("novelty", _novelty, True, "value in a bin of the running range no recent value held (default)")
    _scorer("ensemble", _ensemble, True, "seasonal robust z + distribution change, rank-calibrated")
    _scorer("robust_z", _robust_z, False, "Gaussian surprise of the seasonal robust z-score")
    # Snapshot-level detectors.
    _detector("general", _general, True, "level-novelty scorer + alarm budget per engine/GPU/probe signal")
    _detector(
        "memory_leak", _leak, True, "step-wise GPU memory growth not explained by load; time to exhaustion"
    )
    _detector(
        "fragmentation", _fragmentation, True, "allocator / KV-cache fragmentation above 15%, with trend"
    )
    _detector("scheduler_efficiency", _scheduler, True, "throughput vs the learned batch relation, diagnosed")
    _detector("tail_latency", _tail, True, "P95/P99 per request-length bucket: load-driven vs anomalous")
    _detector("multivariate", _multivariate, True, "Isolation Forest over the engine/GPU state")
    _detector("thermal", _thermal, True, "temperature unexplained by utilisation; throttle reasons")
    _detector("spec_decode", _specdec, True, "spec-decode acceptance vs its baseline; speedup below 1")
    _detector("engine_stall", _stall, True, "requests held, no token, step or engine gauge moving for 60 s")


def _leak() -> base.Detector:
    from detectors.leak import MemoryLeakDetector

    return MemoryLeakDetector()


def _fragmentation() -> base.Detector:
    from detectors.fragmentation import FragmentationDetector

    return FragmentationDetector()


def _scheduler() -> base.Detector:
    from detectors.scheduler import SchedulerEfficiencyDetector

    return SchedulerEfficiencyDetector()


def _tail() -> base.Detector:
    from detectors.tail_latency import TailLatencyDetector

    return TailLatencyDetector()


def _multivariate() -> base.Detector:
    from detectors.multivariate import MultivariateAnomalyDetector

    return MultivariateAnomalyDetector()


def _thermal() -> base.Detector:
    from detectors.thermal import ThermalDetector

    return ThermalDetector()


def _specdec() -> base.Detector:
    from detectors.specdec import SpecDecodeDetector

    return SpecDecodeDetector()


def _stall() -> base.Detector:
    from detectors.stall import EngineStallDetector

    return EngineStallDetector()

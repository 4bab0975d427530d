"""``servepilot replay --config FILE``: replay the settings a sidecar config would run with.

An operator about to change the SLO, give a class its own targets, turn ITL steering on or narrow the
batch bounds wants to see it on a trace first. The replay takes from the config what its engine model
and brain act on, and says what it took:

* ``policies.ttft_slo_s`` / ``itl_slo_s``: the SLO (``--slo`` overrides);
* ``policies.slo_by_priority``, ``itl_steering``, ``served_window_s``: the classes' targets and the
  steering, used with ``--priority-mix`` (the config has no mix: the gate learns it from the traffic);
  ``--class-slo`` and ``--itl-steering`` override;
* ``policies.batch_min`` / ``batch_max``: the auto policies' batch bounds;
* ``gate.max_queue_wait_s`` when the gate is on (``--queue-timeout`` overrides); with the gate off, no
  queue timeout (the engine alone);
* ``policies.energy``: the energy policy (``--energy`` turns it on regardless);
* ``policies.error_budget``: the budget the breaker's burn rates are measured against.

Everything else (lines and rates, the peak schedule, the canary, the actuators) is not replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.config import Config


@dataclass(frozen=True)
class Flags:
    """What the command line set explicitly (None: not given), which the config does not override."""

    slo: tuple[float, float] | None = None
    class_slo: tuple[tuple[str, float | None, float | None], ...] = ()
    itl_steering: str | None = None
    queue_timeout_s: float | None = None
    energy: bool = False


def spec_fields(cfg: Config, flags: Flags, with_classes: bool) -> dict[str, Any]:
    """The :class:`~agent.replay.runner.ReplaySpec` fields ``cfg`` gives, under ``flags``. Without
    classes (no priority mix) the config's class targets and steering are left out; the flags' are
    kept, so that the replay refuses them as it does without a config."""
    p = cfg.policies
    own = tuple((name, slo.ttft_s, slo.itl_s) for name, slo in sorted(p.slo_by_priority.items()))
    fields: dict[str, Any] = {
        "slo": flags.slo or (p.ttft_slo_s, p.itl_slo_s),
        "class_slo": flags.class_slo or (own if with_classes else ()),
        "itl_steering": flags.itl_steering or (p.itl_steering if with_classes else None),
        "served_window_s": p.served_window_s,
        "batch_bounds": (float(p.batch_min), float(p.batch_max)),
        "energy": flags.energy or p.energy,
        "error_budget": p.error_budget,
    }
    if flags.queue_timeout_s is not None:
        fields["queue_timeout_s"] = flags.queue_timeout_s
    else:
        fields["queue_timeout_s"] = cfg.gate.max_queue_wait_s if cfg.gate.enabled else float("inf")
    return fields


def describe(cfg: Config, fields: dict[str, Any], with_classes: bool) -> str:
    """One line saying what the replay takes from ``cfg`` (and what it leaves out without a mix)."""
    ttft, itl = fields["slo"]
    lower, upper = fields["batch_bounds"]
    timeout = fields["queue_timeout_s"]
    parts = [
        f"SLO ttft={ttft:g}s itl={itl:g}s",
        f"batch {lower:g}-{upper:g}",
        "no queue timeout (gate off)" if timeout == float("inf") else f"queue timeout {timeout:g}s",
        "energy on" if fields["energy"] else "energy off",
        f"error budget {fields['error_budget']:.2%}",
    ]
    if with_classes:
        classes = ", ".join(name for name, _, _ in fields["class_slo"]) or "none"
        parts.append(f"class targets: {classes}; itl_steering {fields['itl_steering']}")
    elif cfg.policies.slo_by_priority:
        parts.append("its class targets and itl_steering need --priority-mix")
    return "from the config: " + "; ".join(parts)

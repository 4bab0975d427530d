"""The ITL target the engine-wide policies steer to when priority classes have targets of their own.

The gate judges each class by its own targets (``policies.slo_by_priority``) and scales each class's
queue deadline by its TTFT target, so time to first token is handled per class where it is spent: in
the gate's queue. Inter-token latency is not: the engine decodes every running sequence in the same
steps, so one batch gives every class the same ITL. With ``policies.itl_steering: served_classes`` (the
default) the batch, token-budget, energy and breaker policies steer to the tightest ITL target among the
classes that sent requests lately: interactive traffic with a 50 ms target gets a batch that meets it
while it is there, and a night of batch traffic alone, allowed 200 ms, gets the larger batch that buys.
Without class ITL targets this is ``policies.itl_slo_s``, as with ``global``, which steers to it whatever
is served and leaves a class's tighter target only judged. The default follows the replays with an
interactive class at 0.05 s (docs/policies.md, "Priority classes in replay"): steered, the class met
98.20% on the Azure code trace where ``global`` met 11.94%, and no trace lost attainment by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agent.config import PolicyConfig, priority_targets

#: The name a change of target is audited under (not a knob an actuator turns: the policies' aim).
AUDIT_KNOB = "policies.itl_target_s"


@dataclass(frozen=True)
class ItlTarget:
    """What the policies steer to, and why."""

    itl_s: float
    reason: str = "policies.itl_slo_s"
    #: the classes served within the window, with the ITL target each asks for (empty: none were)
    served: tuple[tuple[str, float], ...] = ()


def steered_itl(policies: PolicyConfig, last_seen: Mapping[str, float], now: float) -> ItlTarget:
    """The ITL target for the policies: ``policies.itl_slo_s`` with ``itl_steering: global``, or when no
    class sent a request within ``served_window_s`` of ``now``; otherwise the tightest target (a class's
    own, or ``itl_slo_s`` for a class without one) among the classes that did."""
    if policies.itl_steering == "global":
        return ItlTarget(policies.itl_slo_s, "policies.itl_slo_s (itl_steering: global)")
    own = priority_targets(policies)
    window_s = policies.served_window_s
    served = tuple(
        (name, own[name][1] if name in own else policies.itl_slo_s)
        for name, seen in sorted(last_seen.items())
        if now - seen <= window_s
    )
    if not served:
        return ItlTarget(
            policies.itl_slo_s, f"no class sent requests in the last {window_s:g} s: policies.itl_slo_s"
        )
    shown = ", ".join(f"{name} {itl:g} s" for name, itl in served)
    why = f"the tightest ITL target of the classes served in the last {window_s:g} s ({shown})"
    return ItlTarget(min(itl for _, itl in served), why, served)


def steering_warnings(policies: PolicyConfig, gate_enabled: bool) -> list[str]:
    """What an operator should hear at start about this config's ITL steering, one line each: steering
    without the gate that sees the classes (when a class has an ITL target of its own to steer to), or a
    class's ITL target tighter than the SLO that, steered globally, is only judged (the batch is sized for
    ``itl_slo_s``, and the class's answers can all miss)."""
    if policies.itl_steering != "global":
        own = [slo.itl_s for slo in policies.slo_by_priority.values() if slo.itl_s is not None]
        if gate_enabled or all(itl == policies.itl_slo_s for itl in own):
            return []
        return [
            f"policies.itl_steering {policies.itl_steering} needs the gate (gate.enabled), which sees the "
            "classes served: the policies steer to policies.itl_slo_s"
        ]
    return [
        f"policies.slo_by_priority.{name}.itl_s {itl:g} s is tighter than policies.itl_slo_s "
        f"{policies.itl_slo_s:g} s, and policies.itl_steering is global: the {name} class is judged by it, "
        "but the batch is sized for itl_slo_s (itl_steering: served_classes sizes it for the class)"
        for name, (_, itl) in sorted(priority_targets(policies).items())
        if itl < policies.itl_slo_s
    ]

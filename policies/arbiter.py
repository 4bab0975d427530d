"""The arbiter: merges every policy's proposals into at most one bounded decision per knob.

Order of authority (highest first): the circuit breaker, the SLO guard, energy, throughput tuning. A
proposal's ``priority`` field carries its class (see :data:`PRIORITY`); for each knob the highest class
wins and lower ones are recorded as overruled. The winner then passes, in order:

1. **bounds**: clamp to ``[lower, upper]`` of the knob;
2. **hysteresis**: a relative change smaller than ``hysteresis`` of the current value is dropped;
3. **max step**: the move is cut to ``max_step`` (relative) of the current value;
4. **rate of change and cooldown**: no change within ``cooldown_s`` of the previous one, unless the
   winner is the breaker (safety overrides comfort);
5. **clamp again** at the end, every time: a value in force outside the bounds (a config reload
   narrowed them) reaches the nearest bound in one move, whatever the step limit.

Categorical knobs (``route.upstream``) skip 2-3. Every decision carries the reason chain, so an operator
can read why a value was chosen or refused. Pure: ``decide(proposals, actual, state, now)``.

**Linked knobs** (:data:`~policies.knobs.LINKED`) are two names for one piece of state: ``route.upstream``
and ``route.fp8_share`` both set the gate's traffic split. Merged per name, a breaker proposing
``route.upstream`` and a canary proposing ``route.fp8_share`` were both applied every tick, each undoing the
other. Across a linked group only the highest class's proposals stand; the rest are overruled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from policies.base import Proposal
from policies.knobs import LINKED, clamp, out_of_range

#: Priority classes of proposals; higher wins.
PRIORITY: Mapping[str, int] = MappingProxyType(
    {"breaker": 40, "slo_guard": 30, "energy": 20, "throughput": 10}
)


@dataclass(frozen=True)
class KnobRule:
    """How far and how often one numeric knob may move."""

    lower: float
    upper: float
    max_step: float = 1.0
    hysteresis: float = 0.0
    cooldown_s: float = 0.0
    integer: bool = False

    def __post_init__(self) -> None:
        if not self.lower <= self.upper:
            raise ValueError(f"knob bounds must satisfy lower <= upper, got [{self.lower}, {self.upper}]")
        if self.max_step <= 0 or self.hysteresis < 0 or self.cooldown_s < 0:
            raise ValueError("max_step must be > 0; hysteresis and cooldown_s >= 0")

    def check(self, knob: str, value: object) -> str | None:
        """Why ``value`` lies outside this rule (None when inside): what an operator's pin is held to."""
        return out_of_range(knob, value, self.lower, self.upper)


@dataclass(frozen=True)
class Decision:
    """What the arbiter decided for one knob: the value to apply (absolute) and the whole reason."""

    knob: str
    value: float | str
    previous: float | str | None
    policy: str
    reason: str
    at: float
    overruled: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "knob": self.knob,
            "value": self.value,
            "previous": self.previous,
            "policy": self.policy,
            "reason": self.reason,
            "at": self.at,
            "overruled": list(self.overruled),
        }


@dataclass(frozen=True)
class ArbiterState:
    """When each knob last changed."""

    changed_at: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Arbiter:
    """Merges proposals by priority and applies each knob's :class:`KnobRule`."""

    rules: Mapping[str, KnobRule]
    breaker_priority: int = PRIORITY["breaker"]
    linked: tuple[frozenset[str], ...] = LINKED

    def check(self, knob: str, value: object) -> str | None:
        """Why ``value`` is outside ``knob``'s bounds (None when inside, or when no rule bounds the knob)."""
        rule = self.rules.get(knob)
        return None if rule is None else rule.check(knob, value)

    def decide(
        self,
        proposals: Sequence[Proposal],
        actual: Mapping[str, float | str],
        state: ArbiterState | None,
        now: float,
    ) -> tuple[ArbiterState, list[Decision]]:
        """Decisions for knobs whose value should change; ``actual`` holds the values in force now."""
        state = state or ArbiterState()
        by_knob: dict[str, list[Proposal]] = {}
        for proposal in proposals:
            by_knob.setdefault(proposal.knob, []).append(proposal)
        across = self._resolve_linked(by_knob)
        decisions: list[Decision] = []
        changed = dict(state.changed_at)
        for knob, group in sorted(by_knob.items()):
            group.sort(key=lambda p: -p.priority)
            winner = group[0]
            overruled = tuple(f"{p.policy}={p.value}" for p in group[1:] if p.value != winner.value)
            overruled += across.get(knob, ())
            current = actual.get(knob)
            decision = self._one(knob, winner, current, changed.get(knob), now)
            if decision is None:
                continue
            changed[knob] = now
            decisions.append(replace(decision, overruled=overruled))
        return ArbiterState(MappingProxyType(changed)), decisions

    def _resolve_linked(self, by_knob: dict[str, list[Proposal]]) -> dict[str, tuple[str, ...]]:
        """Keep, in each linked group, only the knobs proposed at the group's highest class (ties: the
        knob first by name); drop the others from ``by_knob``. Returns, per kept knob, what it overruled."""
        across: dict[str, tuple[str, ...]] = {}
        for group in self.linked:
            present = sorted(knob for knob in group if knob in by_knob)
            if len(present) < 2:
                continue
            top = max(p.priority for knob in present for p in by_knob[knob])
            keep = next(knob for knob in present if any(p.priority == top for p in by_knob[knob]))
            dropped = tuple(
                f"{p.policy}:{knob}={p.value}" for knob in present if knob != keep for p in by_knob[knob]
            )
            for knob in present:
                if knob != keep:
                    del by_knob[knob]
            across[keep] = dropped
        return across

    def _one(
        self, knob: str, winner: Proposal, current: float | str | None, last: float | None, now: float
    ) -> Decision | None:
        value = winner.value
        reason = f"{winner.policy}: {winner.reason}"
        urgent = winner.priority >= self.breaker_priority
        if isinstance(value, str) or isinstance(current, str):
            if value == current:
                return None
            if not urgent and last is not None and now - last < self.rules.get(knob, _ANY).cooldown_s:
                return None
            return Decision(knob, value, current, winner.policy, reason, now)
        rule = self.rules.get(knob)
        if rule is None:
            return None if current == value else Decision(knob, value, current, winner.policy, reason, now)
        target = clamp(float(value), rule.lower, rule.upper)
        if target != value:
            reason += f"; bounded to [{rule.lower:g}, {rule.upper:g}]"
        if current is not None:
            base = float(current)
            if abs(target - base) <= rule.hysteresis * abs(base):
                return None
            if not urgent:
                if last is not None and now - last < rule.cooldown_s:
                    return None
                step = rule.max_step * max(abs(base), 1.0)
                if abs(target - base) > step:
                    target = base + step if target > base else base - step
                    if rule.lower <= target <= rule.upper:
                        reason += f"; step limited to {rule.max_step:.0%}"
                    else:  # the value in force lies outside the bounds (narrowed by a reload): they win
                        reason += f"; outside [{rule.lower:g}, {rule.upper:g}]: to the nearest bound at once"
        target = clamp(target, rule.lower, rule.upper)
        value = round(target) if rule.integer else target  # an int: audited and advised as 4096, not 4096.0
        if current is not None and value == float(current):
            return None
        return Decision(knob, value, current, winner.policy, reason, now)


_ANY = KnobRule(lower=float("-inf"), upper=float("inf"))

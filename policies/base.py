"""The policy Protocol, the Proposal value type and the explicit registry of policies.

A policy is pure: ``decide(snapshot, findings, state, now) -> (state, proposals)``. It never reads the
clock, never performs I/O, and proposes absolute knob values with a reason; the arbiter (later) bounds,
cools down and merges them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from detectors.base import Finding
from detectors.snapshot import Snapshot


@dataclass(frozen=True)
class Proposal:
    """A desired absolute value for one knob, and why."""

    policy: str
    knob: str
    value: float | str
    reason: str
    priority: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "knob": self.knob,
            "value": self.value,
            "reason": self.reason,
            "priority": self.priority,
        }


class Policy(Protocol):
    """``name`` is read-only so that frozen dataclasses (immutable policies) satisfy the Protocol."""

    @property
    def name(self) -> str: ...

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: Any, now: float
    ) -> tuple[Any, list[Proposal]]: ...


@dataclass(frozen=True)
class Registration:
    factory: Callable[[], Policy]
    default_enabled: bool
    description: str


REGISTRY: dict[str, Registration] = {}


def register(name: str, factory: Callable[[], Policy], *, default_enabled: bool, description: str) -> None:
    if name in REGISTRY:
        raise ValueError(f"policy {name!r} is already registered")
    REGISTRY[name] = Registration(factory, default_enabled, description)

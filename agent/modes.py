"""Modes and the actuation step: observe (no actions), advise (log what it would do), act.

:class:`Actuation` is where a policy's :class:`~policies.base.Proposal` meets a knob. It is level-based
(controller-runtime's reconcile): read the knob, do nothing when it already has the desired value, else
write the absolute value. Operator overrides apply here: while paused nothing is written; a pinned knob
gets its pinned value whatever the policies say; a forced value (say ``breaker.level``) is published for
the policies to read. Every non-trivial decision in advise and act becomes an :class:`~agent.audit.Action`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from agent.audit import Action, AuditLog
from policies.base import Proposal

Reader = Callable[[], Awaitable[Any]]
Writer = Callable[[Any], Awaitable[Any]]
Check = Callable[[Any], str | None]
"""Why a value cannot be set on a knob (None when it can): what the knob's own actuator accepts."""
Waiting = Callable[[], str | None]
"""Why a knob's actuator cannot take any value *yet* (None when it can): the GPU actuator before the
probe has named the engine's GPUs. Decisions meanwhile are held, as while paused, not failed."""


class Mode(StrEnum):
    OBSERVE = "observe"
    ADVISE = "advise"
    ACT = "act"


@dataclass(frozen=True)
class KnobBinding:
    """How to read and write one knob (``read`` returns None when unknown). ``write`` returns the value
    actually applied (after clamping), which is what the audit log records."""

    name: str
    read: Reader
    write: Writer
    check: Check | None = None
    waiting: Waiting | None = None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    return bool(a == b)


#: A failure that repeats the one last recorded for a knob (same value, same error) is written to the
#: audit log again only after this long, with how many times it failed in between.
ERROR_REPEAT_S = 300.0
#: Advice that repeats the one last recorded give or take noise (:func:`_near`) is written again only
#: after this long, with how often it came in between and the targets' range.
ADVICE_REPEAT_S = 300.0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _near(current: Any, recorded: Any, target: Any) -> bool:
    """Whether advising ``current -> target`` says what ``current -> recorded`` said: a move the same way,
    ending within half the recorded move of its end. Nothing is applied in advise mode, so the policies
    read the same state each tick and their proposal wobbles with it: beside vLLM, 51 records in four
    minutes alternated between 16 -> 9 and 16 -> 11 (4 or 5 requests running). 64 -> 32 after 64 -> 48 is
    news; 16 -> 11 after 16 -> 9 is not."""
    if not (_number(current) and _number(recorded) and _number(target)):
        return False
    move = float(recorded) - float(current)
    return (
        move * (float(target) - float(current)) > 0 and abs(float(target) - float(recorded)) <= abs(move) / 2
    )


@dataclass
class _Held:
    """The decision last recorded for a knob while nothing is applied (``target``: the one near advice
    is judged against, kept through reminders), and the near ones since."""

    current: Any
    target: Any
    at: float
    repeats: int = 0
    low: float = math.inf
    high: float = -math.inf

    def note(self, target: Any) -> None:  # a number: _number() or _near() said so
        self.repeats += 1
        self.low, self.high = min(self.low, float(target)), max(self.high, float(target))

    def summary(self) -> str:
        return (
            f" (proposed {self.repeats} more time(s) since the last record, to {self.low:g}..{self.high:g})"
        )


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".replace("\n", " ")[:300]


class Actuation:
    """Applies proposals to bound knobs under the mode and the operator's overrides."""

    def __init__(self, mode: Mode | str, audit: AuditLog, *, clock: Callable[[], float] = time.time) -> None:
        self.mode = Mode(mode)
        self.audit = audit
        self.clock = clock
        self.paused = False
        self.pins: dict[str, Any] = {}
        self.forced: dict[str, Any] = {}
        self._knobs: dict[str, KnobBinding] = {}
        #: Unbound knobs seen, with the last value proposed: a policy whose knob this deployment lacks
        #: proposes every tick. In act mode one audited error says so; in advise mode a value is advised
        #: when it changes. One entry per tick would flood the log and the error counter.
        self._unbound: dict[str, Any] = {}
        #: The decision last recorded per knob while nothing is applied (advise mode, or act mode paused,
        #: or the actuator waiting). Policies propose every tick and the value never moves, so the same
        #: advice came once a tick: 26 identical "1980 -> 1824" entries a minute from the energy policy
        #: alone. Near ones (:func:`_near`) are recorded again every ADVICE_REPEAT_S, with count and range.
        self._held: dict[str, _Held] = {}
        #: The failure last recorded per knob: (target, result, recorded at, repeats since). A pin on an
        #: engine knob while the engine is down failed, and was written out, every tick: 86,400 lines a
        #: day, which rotated the real history out of the audit log within two days of an outage.
        self._failing: dict[str, tuple[Any, str, float, int]] = {}
        #: The bounds every policy's value is held to (the arbiter's), for :meth:`check`.
        self.bounds: Callable[[str, Any], str | None] | None = None

    def bind(
        self,
        name: str,
        read: Reader,
        write: Writer,
        check: Check | None = None,
        waiting: Waiting | None = None,
    ) -> None:
        self._knobs[name] = KnobBinding(name, read, write, check, waiting)
        self._unbound.pop(name, None)
        self.audit.declare(name)

    def alias(self, name: str, of: str) -> None:
        """Bind ``name`` to the same actuator as the bound knob ``of`` (KeyError when it is not bound)."""
        bound = self._knobs[of]
        self.bind(name, bound.read, bound.write, bound.check, bound.waiting)

    def check(self, knob: str, value: Any) -> str | None:
        """Why an operator may not pin ``knob`` to ``value``, in one line (None when it may).

        A pin bypasses the policies, not the limits: the knob must be bound here, the value must lie
        inside the bounds every policy is held to, and it must be one the knob's actuator takes.
        Accepted without these, a typo pinned nothing with a 200, ``batch.max_in_flight: 100000`` opened
        the gate past ``policies.batch_max``, and a string on an integer engine knob failed, audited,
        every tick.
        """
        binding = self._knobs.get(knob)
        if binding is None:
            return f"no knob {knob!r} is bound here; bound knobs: {', '.join(self.knobs) or 'none'}"
        why = self.bounds(knob, value) if self.bounds is not None else None
        if why is None and binding.check is not None:
            why = binding.check(value)
        return why

    def binding(self, name: str) -> tuple[Reader, Writer]:
        """How ``name`` is read and written (KeyError when it is not bound)."""
        bound = self._knobs[name]
        return bound.read, bound.write

    @property
    def knobs(self) -> list[str]:
        return sorted(self._knobs)

    async def execute(self, proposal: Proposal) -> Action | None:
        """Carry out (or advise) one proposal; the audited action, or None when nothing was to be done."""
        if self.mode is Mode.OBSERVE:
            return None
        knob, reason, target = proposal.knob, proposal.reason, proposal.value
        if knob in self.pins and proposal.policy != "operator":  # a policy's proposal on a pinned knob
            target, reason = self.pins[knob], f"pinned by operator (policy wanted {proposal.value!r})"
        elif knob in self.pins:  # the pin itself, held while no policy proposes (it said "policy wanted"
            target = self.pins[knob]  # the pinned value, seen live)
        binding = self._knobs.get(knob)
        current = None
        if binding is not None:
            try:
                current = await binding.read()
            except Exception as error:
                return self._failed(
                    knob, None, target, reason, proposal.policy, f"error: read: {_one_line(error)}"
                )
        if binding is not None and _same(current, target):
            self._failing.pop(knob, None)
            return None  # level-based: already there
        if binding is None:
            seen = knob in self._unbound
            if seen and (self.mode is Mode.ACT or _same(self._unbound[knob], target)):
                return None
            self._unbound[knob] = target
            if self.mode is Mode.ADVISE:
                return self._audit(knob, None, target, reason, proposal.policy, "advised")
            why = f"error: no actuator is bound to knob {knob!r} (reported once; later proposals are dropped)"
            return self._audit(knob, None, target, reason, proposal.policy, why)
        waiting = binding.waiting() if binding.waiting is not None and self.mode is Mode.ACT else None
        if self.mode is Mode.ADVISE or self.paused or waiting:
            held, now = self._held.get(knob), self.clock()
            reference = target
            if held is not None and _same(held.current, current):
                if _same(held.target, target):
                    if _number(target):
                        held.note(target)
                    return None  # recorded already: the same advice again is not news
                if _near(current, held.target, target):
                    if now - held.at < ADVICE_REPEAT_S:
                        held.note(target)
                        return None
                    reason += held.summary()  # a reminder: the wobble is still judged against the first
                    reference = held.target
            self._held[knob] = _Held(current, reference, now)
            result = "advised" if self.mode is Mode.ADVISE else "paused" if self.paused else "waiting"
            if waiting and not self.paused:
                reason = f"{reason}; held: {waiting}"
        else:
            self._held.pop(knob, None)
            try:
                target = await binding.write(target)
                result = "ok"
            except Exception as error:  # an actuator failure is audited, never raised into the loop
                return self._failed(
                    knob, current, target, reason, proposal.policy, f"error: {_one_line(error)}"
                )
            self._failing.pop(knob, None)
        return self._audit(knob, current, target, reason, proposal.policy, result)

    def _failed(
        self, knob: str, current: Any, target: Any, reason: str, policy: str, result: str
    ) -> Action | None:
        """Audit a failure, unless it repeats the one last recorded for ``knob`` within
        :data:`ERROR_REPEAT_S`: then it is only counted (the alerts read the counter)."""
        now = self.clock()
        last = self._failing.get(knob)
        if last is not None and _same(last[0], target) and last[1] == result:  # the same failure again
            if now - last[2] < ERROR_REPEAT_S:
                self._failing[knob] = (*last[:3], last[3] + 1)
                self.audit.count(knob, result)
                return None
            if last[3]:
                reason = f"{reason} (failed {last[3]} more time(s) since the last record)"
        self._failing[knob] = (target, result, now, 0)
        return self._audit(knob, current, target, reason, policy, result)

    def _audit(self, knob: str, current: Any, target: Any, reason: str, policy: str, result: str) -> Action:
        action = Action(self.clock(), knob, current, target, reason, policy, self.mode.value, result)
        self.audit.record(action)
        return action

    def state(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "paused": self.paused,
            "pins": dict(self.pins),
            "forced": dict(self.forced),
            "knobs": self.knobs,
        }

"""Brain state that survives a restart: the circuit breaker's and the precision canary's state, the
operator's overrides (pause, pins) and the general detector's baselines.

Without it a restart forgets that the breaker had escalated (traffic goes back to the primary upstream at
full batch while the cause may still be there), an operator's pause or pin silently lifts (a crash loop
would hand the knobs back to the policies the operator had stopped), a canary mid-rollout drops to 0%, and
every per-signal baseline re-learns from scratch (150 points of warm-up with no anomaly scores). The
file at ``agent.state_path`` is written on stop and every ``agent.state_save_interval_s``, atomically
(temp file in the same directory, fsync, ``os.replace``), so a crash leaves the previous state or the
new one, never half a file.

Contents (one pickle of a plain dict)::

    {"version": 1, "servepilot": "0.1.0", "saved_at": <unix s>,
     "policies": {"breaker": {<BreakerState fields>}, "canary": {<CanaryState fields>}},
     "overrides": {"paused": bool, "pins": {knob: value}},
     "gate": {"knobs": {knob: value}, "configured": {...}},   # agent/knobs.py: Knobs.gate_state
     "general": {"scorer": "<module.Class>", "params": {...}, "scorers": {signal: scorer},
                 "thresholders": {signal: thresholder}, "setup": {part: name}}}

The breaker is stored as its dataclass fields (plain values), so a field added later takes its default.
The detector's scorers are pickled objects (a :class:`~detectors.novelty.LevelNoveltyScorer` keeps deques
and dicts that have no JSON form); they are restored only by the same servepilot version with the same
scorer parameters, otherwise the baselines re-learn and the breaker is still restored. Loading uses a
restricted unpickler that resolves only the scorer's and thresholder's classes and ``collections.deque``,
so a tampered file cannot name arbitrary callables. Size: ~57 kB per watched signal once its 5,000-point
window is full (5.7 MB and ~35 ms to pickle for 100 signals), so it is written from a worker thread.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import logging
import pickle
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from agent.loop import Loop
from detectors import atomic_file
from detectors.serving_setup import SetupWatch
from policies.breaker import BreakerState
from policies.canary import CanaryState

log = logging.getLogger(__name__)

VERSION = 1
BREAKER = "breaker"
CANARY = "canary"
GENERAL = "general"
OVERRIDES = "overrides"
GATE = "gate"


def _servepilot_version() -> str:
    try:
        return metadata.version("servepilot")
    except metadata.PackageNotFoundError:
        return "unknown"


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _params(obj: object) -> dict[str, Any]:
    """Constructor parameters (scikit-learn convention: public attributes not ending in ``_``)."""
    return {k: v for k, v in vars(obj).items() if not k.startswith("_") and not k.endswith("_")}


def _general(loop: Loop) -> Any:
    return next((d for d in loop.detectors if getattr(d, "name", None) == GENERAL), None)


def _fresh_pair(detector: Any) -> tuple[Any, Any]:
    return detector.scorer_factory(), detector.thresholder_factory()


def capture(loop: Loop, now: float, actuation: Any = None, gate: Mapping[str, Any] | None = None) -> bytes:
    """The state document as bytes. Runs on the event loop between ticks, so it sees a consistent state.
    ``actuation`` (agent/modes.py), when given, contributes the operator's pause and pins; ``gate`` the
    gate's knobs (agent/knobs.py: ``Knobs.gate_state``)."""
    document: dict[str, Any] = {
        "version": VERSION,
        "servepilot": _servepilot_version(),
        "saved_at": now,
        "policies": {},
    }
    breaker = loop.policy_state(BREAKER)
    if isinstance(breaker, BreakerState):
        document["policies"][BREAKER] = dataclasses.asdict(breaker)
    canary = loop.policy_state(CANARY)
    if isinstance(canary, CanaryState):
        document["policies"][CANARY] = dataclasses.asdict(canary)
    if actuation is not None:
        document[OVERRIDES] = {"paused": bool(actuation.paused), "pins": dict(actuation.pins)}
    if gate is not None:
        document[GATE] = dict(gate)
    detector = _general(loop)
    if detector is not None and getattr(detector, "scorers_", None):
        scorer, _ = _fresh_pair(detector)
        document[GENERAL] = {
            "scorer": _qualname(type(scorer)),
            "params": _params(scorer),
            "scorers": dict(detector.scorers_),
            "thresholders": dict(detector.thresholders_),
            "setup": dict(detector.setup_.seen),
        }
    return pickle.dumps(document, protocol=pickle.HIGHEST_PROTOCOL)


def write_atomically(path: str, data: bytes) -> None:
    """The state file, written atomically (detectors/atomic_file.py)."""
    atomic_file.write_atomically(path, data, prefix=".servepilot-state-")


class _Unpickler(pickle.Unpickler):
    """Resolves only the classes named in ``allowed`` (the Python docs' "restricting globals")."""

    def __init__(self, data: bytes, allowed: Mapping[str, type]) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        cls = self.allowed.get(f"{module}.{name}")
        if cls is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a state file")
        return cls


def read(path: str, loop: Loop) -> dict[str, Any] | None:
    """The saved document, or None when there is none or it is unusable (logged once, never raised)."""
    allowed: dict[str, type] = {"collections.deque": collections.deque}
    detector = _general(loop)
    if detector is not None:
        for obj in _fresh_pair(detector):
            allowed[_qualname(type(obj))] = type(obj)
    try:
        with open(path, "rb") as stream:
            document = _Unpickler(stream.read(), allowed).load()
        if not isinstance(document, dict) or document.get("version") != VERSION:
            raise ValueError("not a servepilot state file of version 1")
    except FileNotFoundError:
        return None
    except Exception as error:  # a corrupt or foreign file must mean a fresh start, not a crash
        log.warning("brain state %s not restored (starting fresh): %s", path, error)
        return None
    return document


def _breaker_state(fields: Mapping[str, Any]) -> BreakerState:
    known = {f.name for f in dataclasses.fields(BreakerState)}
    values = {k: v for k, v in fields.items() if k in known}
    for buckets in ("buckets", "answers"):
        values[buckets] = tuple(tuple(b) for b in values.get(buckets, ()))
    values.pop("mix", None)  # smoothed token rates: the first tick after the restart measures them afresh
    return BreakerState(**values)


def _restore_canary(fields: Mapping[str, Any], loop: Loop) -> str | None:
    if not any(p.name == CANARY for p in loop.policies):
        return None  # the canary was disabled since: its rollout is over
    known = {f.name for f in dataclasses.fields(CanaryState)}
    try:
        state = CanaryState(**{k: v for k, v in fields.items() if k in known})
    except (TypeError, ValueError) as error:
        log.warning("saved canary state ignored: %s", error)
        return None
    loop.set_policy_state(CANARY, state)
    return f"canary {state.phase} (step {state.step})"


def _restore_overrides(
    saved: Mapping[str, Any], actuation: Any, held: dict[str, Any] | None = None
) -> list[str]:
    """The pause, and the pins (:func:`restore_pins`)."""
    restored: list[str] = []
    if saved.get("paused"):
        actuation.paused = True
        restored.append("actuation paused by the operator")
    return restored + restore_pins(dict(saved.get("pins", {})), actuation, held)


def restore_pins(pins: Mapping[str, Any], actuation: Any, held: dict[str, Any] | None = None) -> list[str]:
    """Saved pins that pass the checks an operator's new pin passes (agent/modes.py: the configuration
    may have moved the bounds since the save); the others are logged and dropped. ``held``, when given,
    takes the pins of knobs not bound *yet* (the engine's, while its control API is still being asked
    for), for the caller to restore with this function once they are."""
    restored: list[str] = []
    for knob, value in pins.items():
        why = actuation.check(knob, value)
        if why is None:
            actuation.pins.setdefault(knob, value)  # a pin the operator set since start stands
            restored.append(f"pin {knob}={value!r}")
        elif knob not in actuation.knobs and held is not None:
            held[knob] = value
            restored.append(f"pin {knob}={value!r} (held until the knob is bound)")
        elif knob not in actuation.knobs:
            log.warning(
                "saved pin on %s dropped: no such knob is bound (not in this configuration, or the engine's "
                "control API did not offer it at start)",
                knob,
            )
        else:
            log.warning("saved pin on %s dropped: %s", knob, why)
    return restored


def restore(
    document: Mapping[str, Any], loop: Loop, actuation: Any = None, held: dict[str, Any] | None = None
) -> list[str]:
    """Put the saved state into ``loop`` (and the operator's overrides into ``actuation`` when given; pins
    of knobs not bound yet into ``held`` when given); returns what was restored (for one log line)."""
    restored: list[str] = []
    canary = document.get("policies", {}).get(CANARY)
    if canary is not None and (line := _restore_canary(canary, loop)) is not None:
        restored.append(line)
    if actuation is not None and isinstance(document.get(OVERRIDES), Mapping):
        restored.extend(_restore_overrides(document[OVERRIDES], actuation, held))
    fields = document.get("policies", {}).get(BREAKER)
    if fields is not None and any(p.name == BREAKER for p in loop.policies):
        try:
            state = _breaker_state(fields)
        except (TypeError, ValueError) as error:
            log.warning("saved breaker state ignored: %s", error)
        else:
            loop.set_policy_state(BREAKER, state)
            restored.append(f"breaker L{state.level} (gen {state.generation})")
    saved, detector = document.get(GENERAL), _general(loop)
    if saved is not None and detector is not None:
        scorer, thresholder = _fresh_pair(detector)
        if document.get("servepilot") != _servepilot_version():
            log.info("detector baselines not restored: saved by servepilot %s", document.get("servepilot"))
        elif saved.get("scorer") != _qualname(type(scorer)) or saved.get("params") != _params(scorer):
            log.info("detector baselines not restored: the scorer or its parameters changed")
        else:
            pairs = [
                (name, s, saved["thresholders"].get(name))
                for name, s in saved["scorers"].items()
                if type(s) is type(scorer)
            ][: detector.max_signals]
            for name, s, t in pairs:
                detector.scorers_[name] = s
                detector.thresholders_[name] = (
                    t if type(t) is type(thresholder) else detector.thresholder_factory()
                )
            # what they were learned beside: another setup seen at a tick drops them (detectors/general.py)
            setup = saved.get("setup")
            detector.setup_ = SetupWatch(
                {str(k): str(v) for k, v in setup.items()} if isinstance(setup, Mapping) else {}
            )
            restored.append(f"{len(pairs)} detector baseline(s)")
    return restored


def load_into(
    path: str,
    loop: Loop,
    actuation: Any = None,
    held: dict[str, Any] | None = None,
    gate: dict[str, Any] | None = None,
) -> list[str]:
    """:func:`read` then :func:`restore`; an empty list when nothing was saved or usable. ``gate``, when
    given, takes the saved gate knobs, for the caller to set (they are set from the event loop)."""
    document = read(path, loop)
    if document is None:
        return []
    if gate is not None and isinstance(document.get(GATE), Mapping):
        gate.update(document[GATE])
    restored = restore(document, loop, actuation, held)
    if restored:
        log.info("restored brain state from %s: %s", path, ", ".join(restored))
    return restored

"""What a replica serves with, as its readings tell: the setup that figures learned from it belong to.

A capacity learned from saturated minutes (agent/forecasting.py) and the general detector's baselines
(detectors/general.py) are the engine's, its model's and its GPU's. Both outlive a restart in a state
file, and a state file kept on a volume outlives a change of model or GPU too: the new setup would be
judged by the old one's figures. :class:`SetupWatch` follows the setup tick by tick and says when a part
of it changed, so that what was learned under the old one is learned again.

The parts are the engine and its model (the engine's scrape: vLLM's and SGLang's ``model_name`` label)
and the GPU model (NVML). A part no source told this tick is left out, and not known is no change: the
engine down for a tick, or NVML off. The GPU count is left out on purpose: NVML narrows from every GPU
it sees to the engine's as the sidecar starts.
"""

from __future__ import annotations

from collections.abc import Mapping

from detectors.snapshot import Snapshot, SourceStatus

#: The readings the parts come from, and the keys of their ``info`` that name them.
PARTS = (("engine", "engine", "engine"), ("engine", "model", "model"), ("nvml", "gpu_names", "gpu"))


def serving_setup(snapshot: Snapshot) -> dict[str, str]:
    """The parts of the setup this tick's readings name (see the module docstring)."""
    setup: dict[str, str] = {}
    for source, key, part in PARTS:
        reading = snapshot.readings.get(source)
        if reading is not None and reading.status is SourceStatus.OK and (value := reading.info.get(key)):
            setup[part] = value
    return setup


class SetupWatch:
    """The setup as last seen, each part as its source last named it."""

    __slots__ = ("seen",)

    def __init__(self, seen: Mapping[str, str] | None = None) -> None:
        self.seen: dict[str, str] = dict(seen or {})

    def update(self, snapshot: Snapshot) -> dict[str, tuple[str, str]]:
        """Take in this tick's setup; the parts that changed, each as (before, now). A part seen for the
        first time is no change (a state file from before the setup was kept takes it as it finds it)."""
        setup = serving_setup(snapshot)
        seen = self.seen
        changed = {part: (seen[part], now) for part, now in setup.items() if seen.get(part, now) != now}
        if changed or setup.keys() - seen.keys():
            self.seen = {**seen, **setup}
        return changed


def describe(changed: Mapping[str, tuple[str, str]]) -> tuple[str, str]:
    """``changed`` as two phrases: what was ("model qwen3-4b") and what is ("model qwen3-32b")."""
    return (
        ", ".join(f"{part} {before}" for part, (before, _) in changed.items()),
        ", ".join(f"{part} {now}" for part, (_, now) in changed.items()),
    )

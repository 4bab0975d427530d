"""Which of the GPUs the sidecar sees are its engine's: matched by UUID between the probe and NVML.

A sidecar given ``NVIDIA_VISIBLE_DEVICES=all`` (docs/deploy.md) sees every GPU of the node, its
neighbours' too, under the node's indices; the engine sees only its own, renumbered from 0. The index is
therefore no name the two share, but the UUID is: the allocator probe serves each CUDA device's UUID
(``servepilot_probe_device_info``), the probe collector passes the list on as ``gpu_uuids`` in its
reading's info, and :class:`EngineGpus` hands it to the NVML sampler (watch only those GPUs) and the GPU
actuator (drive only those, put the others back). Both follow only when their ``gpus`` setting is empty:
what an operator named stands.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from detectors.snapshot import SourceStatus

log = logging.getLogger(__name__)

#: the probe collector's source name and its reading's info key (agent/collectors/probe.py)
PROBE_SOURCE = "probe"
INFO_KEY = "gpu_uuids"


def uuid_key(uuid: str) -> str:
    """A UUID as compared: NVML writes lower-case hex after ``GPU-``; tolerate any case and spaces."""
    return uuid.strip().lower()


def indices_of(uuids: Sequence[str], known: Mapping[int, str]) -> tuple[list[int], list[str]]:
    """(indices of the ``known`` GPUs whose UUID is among ``uuids``, in ``uuids``' order; the UUIDs that
    no known GPU has)."""
    by_uuid = {uuid_key(uuid): index for index, uuid in known.items() if uuid}
    found = [by_uuid[uuid_key(u)] for u in uuids if uuid_key(u) in by_uuid]
    missing = [u for u in uuids if uuid_key(u) not in by_uuid]
    return list(dict.fromkeys(found)), missing


def from_probe(info: Mapping[str, str]) -> tuple[str, ...]:
    """The engine's GPU UUIDs in a probe reading's info (empty: the probe did not name them)."""
    return tuple(u for u in (part.strip() for part in info.get(INFO_KEY, "").split(",")) if u)


class Follower(Protocol):
    def follow(self, uuids: Sequence[str] | None) -> None: ...


class EngineGpus:
    """A loop subscriber: tells the followers the engine's GPUs whenever the probe's list changes.

    ``follow(uuids)`` gets the list, or ``None`` once when the probe answers but names no GPU (a probe
    older than ``servepilot_probe_device_info``): the followers then fall back to every GPU they see.
    A probe that is down or still loading says nothing, and the followers keep what they have; so does a
    probe that stops naming GPUs once it has named them.
    """

    def __init__(self, followers: Sequence[Follower]) -> None:
        self.followers = list(followers)
        #: the last list handed on (None before the probe answered, () when it answered without one)
        self.uuids: tuple[str, ...] | None = None

    def on_state(self, state: object) -> None:
        snapshot = getattr(state, "snapshot", None)
        reading = snapshot.readings.get(PROBE_SOURCE) if snapshot is not None else None
        if reading is None or reading.status is not SourceStatus.OK:
            return
        uuids = from_probe(reading.info)
        if uuids == self.uuids or (not uuids and self.uuids):
            return  # unchanged; or the list went missing (a probe restarted older): the last one stands
        self.uuids = uuids
        if uuids:
            log.info("the probe names the engine's GPUs: %s", ", ".join(uuids))
        for follower in self.followers:
            follower.follow(uuids or None)

from __future__ import annotations

import subprocess
import sys

from detectors import base, streaming
from detectors.registry import DEFAULT_SCORER, register_defaults


def test_register_defaults_is_idempotent_and_fills_both_registries() -> None:
    register_defaults()
    register_defaults()
    assert DEFAULT_SCORER in streaming.SCORERS and streaming.SCORERS[DEFAULT_SCORER].default_enabled
    assert "general" in base.REGISTRY


def test_importing_the_registry_registers_nothing() -> None:
    code = (
        "import detectors.registry, detectors.base as b, detectors.streaming as s;"
        "print(len(b.REGISTRY) + len(s.SCORERS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"


def test_every_factory_builds() -> None:
    register_defaults()
    for name, reg in streaming.SCORERS.items():
        assert isinstance(reg.factory(), streaming.StreamingScorer), name

"""The tree's own rules: lint, formatting, import layers and strict typing of every package.

They run as tests so ``make test`` (and CI) fails when a rule is broken.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PACKAGES = ("detectors", "policies", "agent", "simulator", "dashboards")
"""Checked by ``mypy --strict`` (pyproject.toml's ``[tool.mypy]``)."""


def _tool(name: str) -> str:
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; run `make test`, which installs the dev extras")
    return found


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_lint_is_clean() -> None:
    result = _run(_tool("ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    result = _run(_tool("ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_layers_hold() -> None:
    """agent -> policies -> detectors; detectors/ and policies/ import no I/O libraries (import-linter)."""
    result = _run(_tool("lint-imports"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_package_passes_mypy_strict() -> None:
    """The pure packages, and since 2026-12-01 the sidecar, the simulator and the dashboards too (until
    then only detectors/ and policies/ were checked, and agent/ had drifted to 8 errors)."""
    result = _run(_tool("mypy"), *PACKAGES)
    assert result.returncode == 0, result.stdout + result.stderr

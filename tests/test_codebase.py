"""The tree's own rules: lint, formatting, import layers and strict typing of the pure packages.

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


def test_pure_packages_pass_mypy_strict() -> None:
    result = _run(_tool("mypy"), "detectors", "policies")
    assert result.returncode == 0, result.stdout + result.stderr

"""Shared helpers of the deployment tests: the repo root and the dev tools installed beside pytest."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs in CI)")


def tool(name: str) -> str:
    """Path of a console script from the dev extras; a clear failure (not a skip) when it is missing."""
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; run `make test`, which installs the dev extras")
    return found

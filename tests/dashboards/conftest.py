from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of promtool; skipped locally when missing, a failure in CI (where .ci/run installs it)."""
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not found: apt-get install -y prometheus (Debian package)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path

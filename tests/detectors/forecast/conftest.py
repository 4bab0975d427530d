"""Keep torch to one thread: the CI machine is shared."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    """The CI machine is shared: torch (if a test imports it) uses one thread."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)

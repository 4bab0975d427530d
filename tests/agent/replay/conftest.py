from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "replay"


@pytest.fixture
def conv() -> Path:
    return FIXTURES / "azure_conv_head300.csv"


@pytest.fixture
def code() -> Path:
    return FIXTURES / "azure_code_head100.csv"


@pytest.fixture
def mooncake() -> Path:
    return FIXTURES / "mooncake_head150.jsonl"


@pytest.fixture
def counts() -> Path:
    return FIXTURES / "azure2024_counts_head30.csv"

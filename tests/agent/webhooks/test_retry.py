from __future__ import annotations

import random

import pytest

from agent.webhooks.retry import Outcome, backoff_s, classify, retry_after_s


@pytest.mark.parametrize("status", [None, 500, 502, 503, 504, 408, 425, 429])
def test_temporary_failures_are_retried(status: int | None) -> None:
    assert classify(status) is Outcome.RETRY


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 413, 422, 301])
def test_permanent_failures_are_not_retried(status: int) -> None:
    assert classify(status) is Outcome.DROP


def test_2xx_is_delivered() -> None:
    assert classify(200) is Outcome.OK and classify(204) is Outcome.OK


def test_backoff_doubles_within_jitter_bounds() -> None:
    rng = random.Random(1)
    for failures, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0)]:
        waits = [backoff_s(failures, 1.0, 60.0, rng) for _ in range(200)]
        assert ceiling / 2 <= min(waits) and max(waits) <= ceiling
        assert max(waits) - min(waits) > ceiling / 4  # jitter really spreads


def test_backoff_is_capped() -> None:
    assert backoff_s(50, 1.0, 60.0, random.Random(0)) <= 60.0


def test_retry_after_seconds_are_read_and_dates_ignored() -> None:
    assert retry_after_s("7") == 7.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after_s(None) is None

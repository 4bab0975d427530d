"""The after-tick executor: refits start when the tick ends, never inside it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from agent.refits import AfterTickExecutor
from detectors.multivariate import MultivariateAnomalyDetector
from detectors.snapshot import Snapshot


def test_work_waits_for_release_then_runs_in_the_pool() -> None:
    ran_in: list[str] = []
    with ThreadPoolExecutor(1, thread_name_prefix="refit") as pool:
        executor = AfterTickExecutor(pool)
        future = executor.submit(lambda x: ran_in.append(threading.current_thread().name) or x * 2, 21)
        assert not future.done() and ran_in == [] and executor.queued == 1
        assert executor.release() == 1
        assert future.result(timeout=10) == 42
    assert ran_in[0].startswith("refit") and executor.queued == 0


def test_an_exception_reaches_the_future() -> None:
    def fail() -> None:
        raise ValueError("bad fit")

    with ThreadPoolExecutor(1) as pool:
        executor = AfterTickExecutor(pool)
        future = executor.submit(fail)
        executor.release()
        with pytest.raises(ValueError, match="bad fit"):
            future.result(timeout=10)


def test_shutdown_cancels_what_never_started() -> None:
    executor = AfterTickExecutor(ThreadPoolExecutor(1))
    future = executor.submit(lambda: 1)
    executor.shutdown(wait=True, cancel_futures=True)
    assert future.cancelled() and executor.queued == 0


def test_a_detector_refit_lands_only_after_the_tick_released_it() -> None:
    rng = np.random.default_rng(0)
    with ThreadPoolExecutor(1) as pool:
        executor = AfterTickExecutor(pool)
        det = MultivariateAnomalyDetector(
            features=("a", "b"), min_fit=64, refit_every=64, executor=executor, learn_every_s=0.0
        )
        for i in range(64):
            det.update(Snapshot(float(i), {"a": float(rng.normal()), "b": float(rng.normal())}, {}))
        assert det.pending_ is not None and executor.queued == 1  # asked for in this tick, not started
        assert not det.pending_.done()
        executor.release()  # the tick ended
        det.pending_.result(timeout=30)
        det.update(Snapshot(64.0, {"a": 0.0, "b": 0.0}, {}))
        assert det.forest_ is not None and det.pending_ is None

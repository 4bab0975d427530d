"""domain_util: the plain-float RLS against the textbook numpy update, and the per-name-set cache."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.base import Finding, Severity
from detectors.domain_util import KOfN, LastHit, PerNameSet, RecursiveLeastSquares, WindowMax
from detectors.snapshot import Reading, Snapshot, SourceStatus


class _NumpyRls:
    """The RLS update written with numpy matrices (what RecursiveLeastSquares computes with floats)."""

    def __init__(self, n: int, forgetting: float, delta: float) -> None:
        self.lam, self.delta = forgetting, delta
        self.w, self.p, self.n, self.var = np.zeros(n), np.eye(n) * delta, 0, 0.0

    def learn(self, x: np.ndarray, y: float) -> None:
        err = y - float(self.w @ x)
        alpha = max(0.01, 1.0 - self.lam) if self.n >= 10 else 1.0 / (self.n + 1)
        self.var += alpha * (err * err - self.var)
        px = self.p @ x
        gain = px / (self.lam + float(x @ px))
        self.w = self.w + gain * err
        p = (self.p - np.outer(gain, px)) / self.lam
        self.p = np.clip(0.5 * (p + p.T), -1e6 * self.delta, 1e6 * self.delta)
        self.n += 1


@pytest.mark.parametrize(
    ("n", "forgetting", "delta"), [(2, 0.999, 1.0), (3, 0.9995, 1000.0), (4, 0.998, 10.0)]
)
def test_rls_matches_the_matrix_update(n: int, forgetting: float, delta: float) -> None:
    rng = np.random.default_rng(n)
    truth = rng.normal(0.0, 2.0, n)
    fast, ref = RecursiveLeastSquares(n, forgetting, delta), _NumpyRls(n, forgetting, delta)
    for k in range(4000):
        # Stretches of identical input (an idle engine) exercise the covariance bound.
        x = np.ones(n) if k % 1000 < 300 else np.concatenate([[1.0], rng.normal(0.0, 1.0, n - 1)])
        y = float(truth @ x + rng.normal(0.0, 0.1))
        assert fast.predict(x) == pytest.approx(float(ref.w @ x), rel=1e-9, abs=1e-9)
        fast.learn(x, y)
        ref.learn(x, y)
    np.testing.assert_allclose(fast.w_, ref.w, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fast.p_, ref.p, rtol=1e-9, atol=1e-12)
    assert fast.residual_std == pytest.approx(np.sqrt(ref.var), rel=1e-9)
    np.testing.assert_allclose(fast.w_, truth, atol=0.05)  # and it does learn the model


def test_rls_accepts_sequences_and_ignores_non_finite_input() -> None:
    rls = RecursiveLeastSquares(2)
    rls.learn((1.0, 2.0), 5.0)
    rls.learn([1.0, float("nan")], 5.0)
    rls.learn(np.array([1.0, 2.0]), float("inf"))
    assert rls.n_ == 1
    assert rls.predict((1.0, 2.0)) == pytest.approx(rls.predict(np.array([1.0, 2.0])))


def _snap(values: dict[str, float]) -> Snapshot:
    return Snapshot.from_readings(0.0, {"t": Reading("t", 0.0, SourceStatus.OK, values)})


def test_per_name_set_recomputes_only_when_the_names_change() -> None:
    calls: list[int] = []

    def names(snapshot: Snapshot) -> list[str]:
        calls.append(1)
        return sorted(snapshot.values)

    cached = PerNameSet(names)
    assert cached(_snap({"a": 1.0, "b": 2.0})) == ["a", "b"]
    assert cached(_snap({"b": 5.0, "a": 3.0})) == ["a", "b"]  # same names, new values and order
    assert len(calls) == 1
    assert cached(_snap({"a": 1.0, "c": 2.0})) == ["a", "c"]
    assert cached(_snap({})) == []
    assert len(calls) == 3


def _finding(value: float) -> Finding:
    return Finding("d", "s", Severity.WARNING, value, f"value {value:.2f}", 0.0, {"value": value})


def test_last_hit_shows_the_last_positive_check_while_the_gate_holds() -> None:
    """3 of 5: two misses inside a standing alarm show the last hit, noted with the value now."""
    gate, shown = KOfN(3, 5), LastHit()
    seen: list[Finding | None] = []
    for t, value in enumerate([0.9, 0.8, 0.7, 0.1, 0.2, 0.1, 0.1]):
        hit = value > 0.5
        if gate.push(hit, float(t)):
            seen.append(shown.show(gate, hit, lambda v=value: _finding(v), f"{value}"))
        else:  # as the detectors do: nothing is built while the gate is down
            shown.clear()
            seen.append(None)
    assert seen[:2] == [None, None]
    assert seen[2] is not None and seen[2].score == pytest.approx(0.7) and "held" not in seen[2].evidence
    for held, now in ((seen[3], "0.1"), (seen[4], "0.2")):  # still 3 of the last 5: held at 0.7
        assert held is not None and held.score == pytest.approx(0.7)
        assert (
            held.evidence["held"] == "yes" and held.evidence["now"] == now and held.evidence["value"] == 0.7
        )
        assert held.summary == f"value 0.70 (alarm held: 3 of the last 5 checks; now {now})"
    assert seen[5:] == [None, None]  # 2 of 5, then 1: the alarm is down and the last hit forgotten
    assert shown.finding is None


def test_window_max_is_the_largest_value_of_the_window_by_brute_force() -> None:
    rng = np.random.default_rng(3)
    window = WindowMax(10.0)
    times = np.cumsum(rng.uniform(0.1, 3.0, 500))
    values = rng.poisson(2.0, 500).astype(float)
    for i, (now, value) in enumerate(zip(times, values, strict=True)):
        inside = [v for t, v in zip(times[: i + 1], values[: i + 1], strict=True) if t > now - 10.0]
        assert window.push(float(now), float(value)) == max(inside)

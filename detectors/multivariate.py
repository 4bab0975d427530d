r"""Isolation Forest over the multivariate state: the combination is odd even when no single signal is.

Each tick the detector forms a vector of ``features`` (engine load, throughput, tails, GPU utilisation,
temperature, power, clocks, fragmentation). Missing features are imputed with the training median;
a tick with fewer than ``min_present`` of its features is skipped (neither scored nor learned).

Isolation Forest (Liu, Ting & Zhou 2008). Each tree splits on a random feature at a random threshold
until points are isolated; anomalies isolate in few splits. With :math:`h(x)` the path length in one tree
(plus :math:`c(n)` for the unbuilt subtree of a leaf holding :math:`n` training points) and

.. math::
    c(n) = 2 H(n - 1) - \frac{2 (n - 1)}{n}, \qquad H(i) \approx \ln i + \gamma,

the anomaly score is :math:`s(x) = 2^{-\mathbb{E}[h(x)] / c(\psi)}` with :math:`\psi` = ``max_samples``:
about 0.5 for ordinary points, towards 1 for anomalies. This is scikit-learn's ``-score_samples``.

Axis-parallel splits isolate a point that is extreme in one feature, but not one that is ordinary in
every feature and wrong only in combination (high utilisation with low throughput). So the forest sees
each state robustly standardised, :math:`z = (x - \mathrm{med}) / (1.4826\,\mathrm{MAD})`, and rotated
onto the principal axes of the training window, :math:`V z` (:math:`V` from the SVD of the window's
:math:`Z`). A state off the window's correlation structure is extreme along a minor axis and isolates
early (the idea of rotation forests and extended isolation forests, in one linear step).

Streaming: score every tick, learn a row every ``learn_every_s`` of data time (10 s). Rows go into a
bounded window (``window`` rows, so 2048 span 5.7 hours), and one every ``history_every_s`` (10 min)
into a longer one (``history_rows``, 1024: 7 days); the forest is refitted from both every
``refit_every`` rows learned, with a fixed ``seed`` (deterministic). The alarm threshold is the
``1 - contamination`` quantile of the training rows' own scores, so it adapts to how tight "normal" is.

Why rows 10 s apart and a week behind them: a threshold at a quantile of the training scores puts 0.5%
of normal states above it, and the k-of-n gate removes isolated blips but not a run of similar ticks, so
the false findings per day follow how often the state leaves what the training rows span. With a row a
tick the window was the last 34 minutes, and on a healthy replayed day (``bench/soak.py``: the
calibrated simulator at ~1.5 requests/s with a daily cycle) every change of load beyond those 34
minutes was "unusual". The week behind keeps last night's trough and yesterday's peak in view.

**Budget.** At most ``max_findings_per_day`` (2) new findings a day, as the general detector's
per-signal budget: an episode (the k-of-n gate up, until it falls) that finds the budget spent is not
reported at all, and ``budget_.suppressed_total_`` counts it. The first day, while the week behind is
still empty, is the one that needs it.

**Scale.** Each feature is standardised by its median and MAD, as before; a feature whose MAD is 0 (most
of the window at one value: prompt tokens per second and requests waiting at low load are 0 on most
ticks) takes the mean absolute deviation (x 1.2533, the same scale for a normal distribution) instead, and
only a feature constant over the whole window falls back to 1% of its magnitude. Before, such a feature's
scale was 1e-9, so the first prompt after a quiet spell stood 1e12 robust z-scores out and the finding
named it the most unusual feature; z-scores are also clipped to +-``z_clip`` (20) so no one feature
swamps the rotation. A finding needs ``k`` of the last ``n`` ticks above it; its evidence names the
features furthest from the training median in robust z-scores, :math:`(x - \mathrm{med}) /
(1.4826\,\mathrm{MAD})`.

Scoring one point through scikit-learn costs milliseconds (per-call validation, per-tree Python loop),
so a fitted forest is flattened into padded arrays and evaluated for all trees at once in numpy; a test
checks it equals ``IsolationForest.score_samples``.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial

import numpy as np
import numpy.typing as npt

from detectors.base import Finding, Severity
from detectors.domain_util import FloatArray, KOfN, LastHit
from detectors.snapshot import Snapshot
from detectors.thresholds import AlarmBudget

DEFAULT_FEATURES: tuple[str, ...] = (
    "engine.requests_running",
    "engine.requests_waiting",
    "engine.kv_cache_usage_ratio",
    "engine.generation_tokens_per_second",
    "engine.prompt_tokens_per_second",
    "engine.ttft_seconds.p99",
    "engine.itl_seconds.p99",
    "engine.e2e_seconds.p99",
    "engine.preemptions_per_second",
    "nvml.gpu0.utilization_ratio.mean",
    "nvml.gpu0.memory_bandwidth_utilization_ratio.mean",
    "nvml.gpu0.temperature_celsius.mean",
    "nvml.gpu0.power_watts.mean",
    "nvml.gpu0.sm_clock_hz.mean",
    "probe.fragmentation_ratio",
)


def average_path_length(n: FloatArray) -> FloatArray:
    """:math:`c(n)`, the mean path length of an unsuccessful search in a binary search tree of n points."""
    n = np.asarray(n, dtype=np.float64)
    out = np.zeros_like(n)
    two = n == 2
    big = n > 2
    out[two] = 1.0
    out[big] = 2.0 * (np.log(n[big] - 1.0) + np.euler_gamma) - 2.0 * (n[big] - 1.0) / n[big]
    return out


class FlatForest:
    """A fitted ``IsolationForest`` as flat numpy arrays, scored for all trees in one pass.

    Node ``j`` of tree ``i`` is entry ``i * width + j``; children are stored as flat indices too, and a
    leaf's children are the leaf itself, so one descent step is a few ``take`` calls with no leaf test and a
    point that reached its leaf stays there for the remaining steps.
    """

    def __init__(self, forest: object) -> None:
        trees = forest.estimators_  # type: ignore[attr-defined]
        maps = forest.estimators_features_  # type: ignore[attr-defined]
        width = max(t.tree_.node_count for t in trees)
        size = len(trees) * width
        own = np.arange(size, dtype=np.intp)
        self.left, self.right = own.copy(), own.copy()  # padding and leaves point at themselves
        self.feature = np.zeros(size, dtype=np.intp)
        self.threshold = np.zeros(size)
        self.path = np.zeros(size)
        self.roots = np.arange(len(trees), dtype=np.intp) * width
        leaf = np.zeros(size, dtype=bool)
        samples = np.zeros(size)
        for i, (est, fmap) in enumerate(zip(trees, maps, strict=True)):
            tree, m, base = est.tree_, est.tree_.node_count, i * width
            left, right = np.asarray(tree.children_left), np.asarray(tree.children_right)
            inner = left >= 0
            self.left[base : base + m] = np.where(inner, left + base, own[base : base + m])
            self.right[base : base + m] = np.where(inner, right + base, own[base : base + m])
            feats = np.asarray(tree.feature)
            self.feature[base : base + m] = np.where(feats >= 0, np.asarray(fmap)[np.maximum(feats, 0)], 0)
            self.threshold[base : base + m] = tree.threshold
            leaf[base : base + m] = ~inner
            samples[base : base + m] = tree.n_node_samples
        # Depth of every node, level by level over all trees at once (children follow their parent).
        depth = np.zeros(size)
        frontier, level = self.roots, 0
        while frontier.size:
            frontier = frontier[~leaf[frontier]]
            level += 1
            frontier = np.concatenate([self.left[frontier], self.right[frontier]])
            depth[frontier] = level
        self.depth = level - 1
        self.path = depth + average_path_length(samples)
        psi = float(forest.max_samples_)  # type: ignore[attr-defined]
        self.norm = len(trees) * float(average_path_length(np.array([psi]))[0])

    def score(self, x: FloatArray) -> FloatArray:
        """:math:`s(x)` per row of ``x`` (shape ``(m, d)``); equals ``-IsolationForest.score_samples``."""
        x = np.asarray(x, dtype=np.float32).astype(np.float64)  # sklearn compares in float32
        d = x.shape[1]
        flat_x = x.ravel()
        node = np.repeat(self.roots[:, None], x.shape[0], axis=1)  # (trees, m) flat node indices
        offset = (np.arange(x.shape[0], dtype=np.intp) * d)[None, :]
        for _ in range(self.depth):
            values = flat_x.take(self.feature.take(node) + offset)
            node = np.where(values <= self.threshold.take(node), self.left.take(node), self.right.take(node))
        depths = self.path.take(node).sum(axis=0)
        return np.asarray(2.0 ** (-depths / self.norm), dtype=np.float64)


@dataclass(frozen=True)
class _Fit:
    seen: npt.NDArray[np.bool_]
    median: FloatArray
    scale: FloatArray
    rotation: FloatArray
    forest: FlatForest
    threshold: float


def _embed(
    rows: FloatArray, median: FloatArray, scale: FloatArray, rotation: FloatArray, clip: float
) -> FloatArray:
    z = np.clip((rows - median) / scale, -clip, clip)
    return np.asarray(z @ rotation.T, dtype=np.float64)


def _within(last: float | None, now: float, step: float) -> bool:
    """``now`` is less than ``step`` after ``last`` (time that steps back is not within)."""
    return last is not None and last <= now < last + step


def robust_scale(data: FloatArray, median: FloatArray) -> FloatArray:
    """Per column: 1.4826 x MAD; where that is 0, 1.2533 x the mean absolute deviation from the median;
    where the column is constant, 1% of its magnitude (1e-9 around 0). Both factors give a normal
    distribution's standard deviation (the fallback is the modified z-score's, Iglewicz & Hoaglin)."""
    deviation = np.abs(data - median)
    mad = np.median(deviation, axis=0) * 1.4826
    mean_ad = np.mean(deviation, axis=0) * 1.2533
    constant = np.maximum(np.abs(median) * 0.01, 1e-9)
    return np.asarray(np.where(mad > 0, mad, np.where(mean_ad > 0, mean_ad, constant)), dtype=np.float64)


class MultivariateAnomalyDetector:
    """Isolation Forest over the engine and GPU state, refitted from a bounded window on a schedule."""

    name = "multivariate"

    def __init__(
        self,
        features: tuple[str, ...] = DEFAULT_FEATURES,
        window: int = 2048,
        min_fit: int = 256,
        refit_every: int = 32,
        n_estimators: int = 100,
        max_samples: int = 256,
        contamination: float = 0.005,
        min_present: float = 0.5,
        seed: int = 0,
        k: int = 3,
        n: int = 5,
        executor: Executor | None = None,
        learn_every_s: float = 10.0,
        z_clip: float = 20.0,
        history_rows: int = 1024,
        history_every_s: float = 600.0,
        max_findings_per_day: float = 2.0,
    ) -> None:
        self.features = features
        self.window = window
        self.min_fit = min_fit
        self.refit_every = refit_every
        self.n_estimators = n_estimators
        self.max_samples = max_samples
        self.contamination = contamination
        self.min_present = min_present
        self.seed = seed
        self.k = k
        self.n = n
        self.learn_every_s = learn_every_s
        self.z_clip = z_clip
        self.rows_: deque[FloatArray] = deque(maxlen=window)
        self.learned_at_: float | None = None
        self.history_every_s = history_every_s
        #: a row every ``history_every_s`` (1024 rows 10 min apart: 7 days), trained on with ``rows_``
        self.history_: deque[FloatArray] = deque(maxlen=history_rows)
        self.kept_at_: float | None = None
        self.budget_ = AlarmBudget(max_findings_per_day, burst=max(1.0, max_findings_per_day))
        #: whether the standing alarm episode was let through by the budget (None: no episode)
        self.episode_shown_: bool | None = None
        self.forest_: FlatForest | None = None
        self.median_: FloatArray = np.zeros(len(features))
        self.scale_: FloatArray = np.ones(len(features))
        self.rotation_: FloatArray = np.eye(len(features))
        self.seen_: npt.NDArray[np.bool_] = np.ones(len(features), dtype=bool)
        self.threshold_: float = 1.0
        self.since_fit_: int = 0
        self.gate_ = KOfN(k, n)
        self.shown_ = LastHit()
        # None: refits run inline (deterministic: tests, replay). The live agent passes a worker thread so
        # a refit (sklearn's fit: ~0.1-0.5 s) never stalls a tick; the old forest scores until it lands.
        self.executor = executor
        self.pending_: Future[_Fit] | None = None

    def suppressed_total(self) -> int:
        """Episodes the daily budget dropped so far (``servepilot_findings_suppressed_total``)."""
        return self.budget_.suppressed_total_

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Score the state vector with the current forest, then add it to the window (refit when due)."""
        row = np.array([v if (v := snapshot.get(f)) is not None else math.nan for f in self.features])
        present = np.isfinite(row)
        if present.sum() < max(1, math.ceil(self.min_present * len(self.features))):
            return []
        findings: list[Finding] = []
        if self.forest_ is not None:
            present = present & self.seen_
            filled = np.where(present, row, self.median_)
            score = float(self.forest_.score(self._embed(filled[None, :]))[0])
            hit = score > self.threshold_
            active = self.gate_.push(hit, snapshot.now)
            if active and self.episode_shown_ is None:  # a new episode: does the budget let it through?
                self.episode_shown_ = self.budget_.spend(snapshot.now)
            if active and self.episode_shown_:
                build = partial(self._finding, filled, present, score, snapshot.now)
                findings.append(self.shown_.show(self.gate_, hit, build, f"score {score:.2f}"))
            elif not active:
                self.shown_.clear()
                self.episode_shown_ = None
        if self.pending_ is not None and self.pending_.done():
            pending, self.pending_ = self.pending_, None
            self._apply(pending.result())
        if _within(self.learned_at_, snapshot.now, self.learn_every_s):
            return findings  # scored, not learned: the next row is due learn_every_s after the last
        self.learned_at_ = snapshot.now
        self.rows_.append(row)
        if not _within(self.kept_at_, snapshot.now, self.history_every_s):
            self.kept_at_ = snapshot.now
            self.history_.append(row)
        self.since_fit_ += 1
        due = len(self.rows_) >= self.min_fit and (
            self.forest_ is None or self.since_fit_ >= self.refit_every
        )
        if due and self.pending_ is None:
            data = np.array([*self.history_, *self.rows_])
            if self.executor is None:
                self._apply(self._compute(data))
            else:
                self.since_fit_ = 0
                self.pending_ = self.executor.submit(self._compute, data)
        return findings

    def _apply(self, fit: _Fit) -> None:
        self.seen_, self.median_, self.scale_, self.rotation_ = fit.seen, fit.median, fit.scale, fit.rotation
        self.forest_, self.threshold_ = fit.forest, fit.threshold
        self.since_fit_ = 0

    def _compute(self, data: FloatArray) -> _Fit:
        """A new forest and its standardisation from ``data`` (pure: safe in a worker thread)."""
        from sklearn.ensemble import IsolationForest  # heavy import, only when a fit is due

        finite = np.isfinite(data)
        # A feature never seen in the window carries no notion of normal: it is masked when scoring.
        seen = np.asarray(finite.any(axis=0), dtype=bool)
        median = np.array(
            [float(np.median(c[ok])) if ok.any() else 0.0 for c, ok in zip(data.T, finite.T, strict=True)]
        )
        data = np.where(finite, data, median)
        scale = robust_scale(data, median)
        z = np.clip((data - median) / scale, -self.z_clip, self.z_clip)
        rotation = np.linalg.svd(z - z.mean(axis=0), full_matrices=False)[2]
        embedded = _embed(data, median, scale, rotation, self.z_clip)
        forest = FlatForest(
            IsolationForest(
                n_estimators=self.n_estimators,
                max_samples=min(self.max_samples, len(data)),
                random_state=self.seed,
            ).fit(embedded)
        )
        threshold = float(np.quantile(forest.score(embedded), 1.0 - self.contamination))
        return _Fit(seen, median, scale, rotation, forest, threshold)

    def _embed(self, rows: FloatArray) -> FloatArray:
        """Robustly standardised features projected onto the training window's principal axes."""
        return _embed(rows, self.median_, self.scale_, self.rotation_, self.z_clip)

    def _finding(self, row: FloatArray, present: npt.NDArray[np.bool_], score: float, now: float) -> Finding:
        z = np.where(present, np.clip((row - self.median_) / self.scale_, -self.z_clip, self.z_clip), 0.0)
        top = np.argsort(-np.abs(z))[:3]
        described = ", ".join(f"{self.features[i]} z={z[i]:+.1f}" for i in top if abs(z[i]) > 0)
        evidence: dict[str, float | str] = {
            "anomaly_score": score,
            "threshold": self.threshold_,
            "top_features": described or "none stands out alone",
        }
        for i in top:
            evidence[self.features[i]] = float(row[i])
        excess = (score - self.threshold_) / max(1e-9, 1.0 - self.threshold_)
        return Finding(
            detector=self.name,
            signal="state",
            severity=Severity.WARNING,
            score=0.5 + 0.5 * excess,
            summary=f"unusual combination of engine and GPU state (score {score:.2f} > "
            f"{self.threshold_:.2f}); most unusual: {described or 'no single feature'}",
            since=self.gate_.since(now),
            evidence=evidence,
            hint="The state as a whole is unlike the last window: read the named features together "
            "(e.g. high utilisation with low throughput points at throttling or a stuck kernel).",
        )

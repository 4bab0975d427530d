"""The general anomaly detector: one streaming scorer and one thresholder per snapshot signal.

It adapts any :class:`~detectors.streaming.StreamingScorer` to the snapshot-level
:class:`~detectors.base.Detector` Protocol: every tick, each selected signal present in the snapshot is
scored (score first, then learn) and fed to its :class:`~detectors.thresholds.Thresholder`; a newly
raised alarm becomes a :class:`~detectors.base.Finding`. Signals absent from a snapshot are simply not
updated (missing data is absence, never NaN). ``max_signals`` bounds memory when a scrape explodes.

**One traffic change, one warning.** When traffic starts, stops or steps, nearly every signal moves
with it: GPU utilisation, memory bandwidth, power, clocks, temperature, the allocator's bytes, the
engine's token rates. Each is "unusual" to its own scorer, and a sidecar that had seen only an idle
engine raised eleven warnings, one per signal, when the first traffic came. The load signals
(:data:`DEFAULT_LOAD_SIGNALS`: requests running and waiting, request and token rates) say when the load
itself moved: a score of at least ``load_threshold`` (0.99: for the novelty scorer a level five bins or
more beyond any recent one, where a noise tail lands one to three bins out and scores 0.9-0.975). An
alarm within ``load_window_s`` of such a move is *with the load*: the first load signal's alarm is the
one warning ("the load changed"); every other alarm in that window is an ``info`` finding that names
the load signal, kept in ``/api/state`` and the finding metrics but below the webhooks' default
``min_severity``. An alarm with no load move near it
stays a warning: that is what the detector is for. The specific failure modes that also move with the
load have their own detectors and severities (thermal, leak, fragmentation, stall, tail latency).

**One signal, one judge.** Latency tails (``engine.*_seconds.p90/p95/p99``) are not watched here: the
tail latency detector models each against utilisation and the queue and judges it against its SLO, so a
load-blind novelty alarm on the same tail said the same thing worse. On the Azure 2024 coding week
(``bench/soak.py --week``, counted before f1405c6 fed each tick once) 9 of this detector's 30 warnings
were TTFT and ITL tails at the weekday peaks, each also judged there. The window means
(``engine.ttft_seconds.mean``, ``itl_seconds.mean``) are still watched: no other detector does.

**A new low of a signal where low is good is good news.** The latency means, the GPU temperature and
the preemption rate (:data:`DEFAULT_BENIGN_LOW`) are a problem when they rise; a level below anything
recently seen is a quiet night or a faster engine. On the Azure 2024 coding week two of the first
week's warnings were such lows (a TTFT mean of 34 ms, a GPU at 41 C). An alarm on one of these signals
below its usual level (an EWMA with a one-hour half-life, ``benign_low_half_life_s``) is ``info``
("unusually low"); above it, it is judged as any other.

**An engine restart explains what follows it.** A restarted engine starts cold: its load falls to
nothing and comes back, its step sizes, memory and caches find new levels. Beside a vLLM killed and
restarted under load, the tokens per step (``engine.iteration_tokens.p95``) raised a warning within 5 s
of its being back, for a change whose cause was already known. The engine's process start time
(``engine.process_start_time_seconds``, where its ``/metrics`` says it: vLLM, SGLang) moving is one info
finding, "the engine restarted", held ``hold_s``; an alarm within ``restart_window_s`` after it is info
too, naming the restart. Not a hang nor a crash loop: those have their own detector and alerts.

**A new baseline settles first.** For its first ``settle_points`` points (3600: an hour at the agent's
1 s tick) a signal's scorer has seen little of its range, and each widening of it scores as a new level:
a fresh sidecar beside a healthy engine raised 15 warnings in its first hour (``bench/soak.py``), one per
signal, none after it that day. An alarm in that hour is info ("while its baseline settles"), unless it
is far out (a score of at least ``load_threshold``, five bins or more beyond anything seen), which stays
a warning. A load signal's alarm in that hour is info however far out: traffic a baseline minutes old has
not seen is what a new pod gets first (every live run beside vLLM warned "the load changed" on
``engine.requests_waiting`` two to three minutes in, and each pod a rollout or a scale-out starts would
send that warning to the webhooks). The count is the scorer's own (``n_seen``), so baselines restored
from ``agent.state_path`` are settled at once.

**Baselines are the setup's.** They were learned beside one engine, model and GPU model
(detectors/serving_setup.py). When the replica serves with another (a larger model after an upgrade, with
the state kept on a volume, or an engine restarted with other arguments), every level moves at once and
each signal would warn until its window forgot the old setup, over an hour at a 1 s tick. Instead every
baseline is dropped and learned again (settling as a new one does), with one info finding,
:data:`SETUP_CHANGED`, naming the old and the new setup.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from detectors.base import Finding, Severity
from detectors.domain_util import ENGINE_STARTED, RestartWatch
from detectors.serving_setup import SetupWatch, describe
from detectors.snapshot import Snapshot
from detectors.streaming import StreamingScorer
from detectors.thresholds import Thresholder

#: Signals the general detector leaves alone by default: cumulative counters (always "new" values),
#: configuration-like constants, categorical bitmasks and per-pid/per-device detail, and the redundant
#: ``max``/``last``/``p50`` views of signals whose ``mean``/``p95``/``p99`` are watched. This keeps the cost
#: per tick proportional to what an operator would chart, not to the size of the scrape.
#: Signals that say how much load the engine has: when one of them is unusual, the rest follow from it.
#: The finding of a change of setup, by which every baseline was learned again.
SETUP_CHANGED = "serving_setup"
DEFAULT_LOAD_SIGNALS = (
    "engine.requests_running",
    "engine.requests_waiting",
    "engine.requests_finished_per_second",
    "engine.prompt_tokens_per_second",
    "engine.generation_tokens_per_second",
)
#: Signals for which only a rise can be a fault: a new low of one is info (module docstring).
DEFAULT_BENIGN_LOW = r"(_seconds\.mean$)|(temperature_celsius\.mean$)|(preemptions_per_second$)"
#: Signals not watched: redundant views (max, last, p50), counters and static values, per-process,
#: per-device and per-draft-position series, latency tails (``_seconds.p90/p95/p99``), which the tail
#: latency detector judges against the load and the SLO, and the decode tokens per step, which follow
#: the drafts' acceptance that the spec_decode detector judges (one signal, one judge: module docstring).
DEFAULT_EXCLUDE = (
    r"(\.(max|last|p50|samples)$)|(_total$)|(energy_joules$)|(\.throttle)|(process_used_bytes)"
    r"|(^probe\.device)|(\.position\d+$)|(memory_total_bytes$)|(power_limit_watts$)|(_info$)"
    r"|(_seconds\.p9[059]$)|(decode_tokens_per_step$)|(process_start_time_seconds$)"
)


class GeneralAnomalyDetector:
    """Per-signal scoring and alarming (see the module docstring)."""

    name = "general"

    def __init__(
        self,
        scorer_factory: Callable[[], StreamingScorer],
        thresholder_factory: Callable[[], Thresholder] = Thresholder,
        signals: Iterable[str] | None = None,
        prefixes: tuple[str, ...] = ("engine.", "nvml.", "probe."),
        max_signals: int = 512,
        exclude: str | None = DEFAULT_EXCLUDE,
        hold_s: float = 300.0,
        load_signals: Iterable[str] = DEFAULT_LOAD_SIGNALS,
        load_threshold: float = 0.99,
        load_window_s: float = 120.0,
        settle_points: int = 3600,
        benign_low: str | None = DEFAULT_BENIGN_LOW,
        benign_low_half_life_s: float = 3600.0,
        restart_window_s: float = 300.0,
    ) -> None:
        self.scorer_factory = scorer_factory
        self.thresholder_factory = thresholder_factory
        self.signals = None if signals is None else frozenset(signals)
        self.prefixes = prefixes
        self.max_signals = max_signals
        self.exclude = exclude
        self.hold_s = hold_s
        self.load_signals = frozenset(load_signals)
        self.load_threshold = load_threshold
        self.load_window_s = load_window_s
        self.settle_points = settle_points
        self._exclude = re.compile(exclude) if exclude else None
        self.benign_low = benign_low
        self.benign_low_half_life_s = benign_low_half_life_s
        self._benign_low = re.compile(benign_low) if benign_low else None
        #: the usual level (EWMA) and its time of each watched benign-low signal
        self.levels_: dict[str, tuple[float, float]] = {}
        self._watch_cache: dict[str, bool] = {}
        self._keys: frozenset[str] = frozenset()
        self._order: list[str] = []
        self._low_order: list[str] = []
        self.active_: dict[str, Finding] = {}
        self.scorers_: dict[str, StreamingScorer] = {}
        self.thresholders_: dict[str, Thresholder] = {}
        self.last_scores_: dict[str, float] = {}
        #: the last time a load signal scored at ``load_threshold``, and the first that did in this change
        self.load_moved_: tuple[float, str] | None = None
        #: the load signal whose warning reported the current load change (one per change)
        self.load_warning_: str | None = None
        self.restart_window_s = restart_window_s
        self.restarts_ = RestartWatch()
        #: the setup the baselines were learned beside (persisted with them: agent/persist.py)
        self.setup_ = SetupWatch()
        #: alarms suppressed by thresholders since dropped (a setup change): the count only rises
        self.suppressed_before_ = 0

    def suppressed_total(self) -> int:
        """Alarms the per-signal budgets dropped so far (``servepilot_findings_suppressed_total``)."""
        return self.suppressed_before_ + sum(t.suppressed_total_ for t in self.thresholders_.values())

    def _watched(self, name: str) -> bool:
        known = self._watch_cache.get(name)
        if known is None:
            if self.signals is not None:
                known = name in self.signals
            else:
                known = name.startswith(self.prefixes) and not (self._exclude and self._exclude.search(name))
            if len(self._watch_cache) > 4 * self.max_signals:
                self._watch_cache.clear()
            self._watch_cache[name] = known
        return known

    def _watched_in(self, snapshot: Snapshot) -> list[str]:
        """The watched names of ``snapshot``, sorted; recomputed only when its set of names changes (a
        tick normally carries the same names as the one before)."""
        keys = snapshot.values.keys()
        if keys != self._keys:
            self._keys = frozenset(keys)
            self._order = [name for name in sorted(keys) if self._watched(name)]
            pattern = self._benign_low
            self._low_order = [n for n in self._order if pattern and pattern.search(n)]
        return self._order

    def _usual(self, name: str, value: float, now: float) -> float:
        """The usual level of a benign-low signal before this value, then learn it."""
        seen = self.levels_.get(name)
        if seen is None or now <= seen[0]:
            self.levels_[name] = (now, value)
            return value if seen is None else seen[1]
        w = 1.0 - 2.0 ** (-(now - seen[0]) / self.benign_low_half_life_s)
        self.levels_[name] = (now, seen[1] + w * (value - seen[1]))
        return seen[1]

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Score every watched signal in ``snapshot`` at ``snapshot.now``, then learn.

        Returns the active findings: an alarm stays active for ``hold_s`` after it was raised, so it is
        visible in ``/api/state`` and as ``servepilot_finding_active`` rather than for a single tick.
        """
        findings: list[Finding] = []
        values, now = snapshot.values, snapshot.now
        scorers, thresholders, last_scores = self.scorers_, self.thresholders_, self.last_scores_
        raised: list[tuple[str, float]] = []
        if self.restarts_.feed(snapshot):
            self._restarted(now)
        changed = self.setup_.update(snapshot)
        if changed and scorers:
            self._learn_again(now, changed)
        for name in self._watched_in(snapshot):
            scorer = scorers.get(name)
            if scorer is None:
                if len(scorers) >= self.max_signals:
                    continue
                scorer = scorers[name] = self.scorer_factory()
                thresholders[name] = self.thresholder_factory()
            score = scorer.update(now, values[name])
            last_scores[name] = score
            if thresholders[name].push(now, score):
                raised.append((name, score))
            if name in self.load_signals and score >= self.load_threshold:
                moved = self.load_moved_
                if moved is None or now - moved[0] > self.load_window_s:
                    self.load_moved_ = (now, name)  # a new load change: it gets its own warning
                    self.load_warning_ = None
                else:
                    self.load_moved_ = (now, moved[1])  # the same change goes on
        usual = {name: self._usual(name, values[name], now) for name in self._low_order}
        for name, score in raised:
            self.active_[name] = self._finding(name, values[name], score, now, usual.get(name))
        for name, finding in list(self.active_.items()):
            if snapshot.now - finding.since > self.hold_s:
                del self.active_[name]
            else:
                findings.append(finding)
        return findings

    def _restarted(self, now: float) -> None:
        """Report the engine's restart (module docstring)."""
        started = self.restarts_.started
        assert started is not None
        self._note(
            ENGINE_STARTED,
            now,
            f"the engine restarted: its process started {max(0.0, now - started):.0f} s ago",
            {"started_at": started},
            f"alarms in the next {self.restart_window_s:.0f} s are reported as info: a cold engine's "
            "levels move; the container's restart reason says why it restarted",
        )

    def _learn_again(self, now: float, changed: dict[str, tuple[str, str]]) -> None:
        """Drop every baseline, learned beside another setup (module docstring), and say so."""
        self.suppressed_before_ = self.suppressed_total()
        for learned in (self.scorers_, self.thresholders_, self.last_scores_, self.levels_):
            learned.clear()
        was, is_now = describe(changed)
        self._note(
            SETUP_CHANGED,
            now,
            f"this replica now serves with {is_now} (was {was}): every baseline is learned again",
            {"was": was, "now": is_now},
            f"alarms in the next {self.settle_points} points are info, as for a new sidecar, unless far out: "
            "the old baselines would have judged the new setup by the old one's levels",
        )

    def _note(
        self, signal: str, now: float, summary: str, evidence: dict[str, float | str], hint: str
    ) -> None:
        """An info finding of the detector's own (not a signal's alarm), active for ``hold_s``."""
        self.active_[signal] = Finding(
            detector=self.name,
            signal=signal,
            severity=Severity.INFO,
            score=1.0,
            summary=summary,
            since=now,
            evidence=evidence,
            hint=hint,
        )

    def _finding(
        self, name: str, value: float, score: float, now: float, usual: float | None = None
    ) -> Finding:
        """The finding of an alarm raised at ``now``: a warning, unless the load moved within
        ``load_window_s`` and its one warning was already given, or it is a benign signal's new low
        (module docstring). ``usual``: a benign-low signal's usual level."""
        evidence: dict[str, float | str] = {"value": value, "score": score}
        moved = self.load_moved_
        with_load = moved is not None and now - moved[0] <= self.load_window_s
        severity = Severity.WARNING
        seen = getattr(self.scorers_[name], "n_seen", self.settle_points)
        if usual is not None and value < usual:
            evidence["usual"] = usual
            severity = Severity.INFO
            summary = (
                f"{name} is unusually low (anomaly score {score:.2f}): {value:.4g} against a usual "
                f"{usual:.4g}"
            )
            hint = "lower is better for this signal: a quiet spell or a faster engine, not a fault"
        elif (ago := self.restarts_.within(now, self.restart_window_s)) is not None:
            evidence["engine_restarted_s_ago"] = ago
            severity = Severity.INFO
            summary = f"{name} is unusual (anomaly score {score:.2f}), {ago:.0f} s after the engine restarted"
            hint = "a cold engine's levels move after a restart; alone it is no fault"
        elif seen < self.settle_points and name in self.load_signals:
            evidence["settling_points"] = seen
            severity = Severity.INFO
            self.load_warning_ = self.load_warning_ or name
            summary = (
                f"the load changed while its baseline settles: {name} is unusual (anomaly score "
                f"{score:.2f}; {seen} of {self.settle_points} points seen)"
            )
            hint = (
                "traffic a young baseline has not seen yet (a new pod's first traffic, a sidecar restarted "
                "without its state); once settled, a change this far out is a warning"
            )
        elif seen < self.settle_points and score < self.load_threshold:
            evidence["settling_points"] = seen
            severity = Severity.INFO
            summary = (
                f"{name} is unusual (anomaly score {score:.2f}) while its baseline settles "
                f"({seen} of {self.settle_points} points seen)"
            )
            hint = "a new baseline widening to the signal's range; a level far beyond it would be a warning"
        elif (
            moved is not None
            and with_load
            and (self.load_warning_ is not None or name not in self.load_signals)
        ):
            load = self.load_warning_ or moved[1]
            evidence["with_load"] = load
            severity = Severity.INFO
            summary = f"{name} is unusual (anomaly score {score:.2f}), as is the load ({load})"
            hint = (
                "it moved with a change of traffic; alone it is no fault (the load's own finding, and the "
                "specific detectors, say more)"
            )
        elif name in self.load_signals:
            self.load_warning_ = name
            summary = f"the load changed: {name} is unusual (anomaly score {score:.2f})"
            hint = (
                "a traffic change the baseline has not seen: a surge, a drop or a new mix; signals that "
                "move with it in the next minutes are reported as info"
            )
        else:
            summary = f"{name} is unusual (anomaly score {score:.2f})"
            hint = "compare with the signal's baseline in Grafana; see other findings for a cause"
        return Finding(
            detector=self.name,
            signal=name,
            severity=severity,
            score=score,
            summary=summary,
            since=now,
            evidence=evidence,
            hint=hint,
        )

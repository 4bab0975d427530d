"""Bounded history of every signal: one ring buffer per series, so memory does not grow with uptime.

Layout: two preallocated 2-D float64 slabs, ``times[row, slot]`` and ``values[row, slot]``, one row per
series and ``points_per_series`` slots per row, plus per-row write position, fill count and the tick at
which the row was last written. A snapshot's ~400 values are written with one fancy-indexed assignment
per array, so an append costs a dict lookup per name plus O(1) numpy work, independent of history length.

Rows are allocated lazily in doubling steps up to ``max_series`` (a node with 400 signals and 3600
points uses ~23 MB, not the 236 MB the default ``max_series`` would cost up front). When a snapshot brings
a new name and every row is taken, the least-recently-updated series is evicted and its row reused;
``evictions`` counts them for the exporter. A snapshot with more distinct names than ``max_series`` keeps
the first ``max_series`` and counts the rest in ``dropped_values`` (rows updated by the current snapshot
are never evicted to make room for its own names).

Not thread-safe: the control loop owns it and runs on one event loop.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from detectors.snapshot import Snapshot

_EMPTY = np.empty(0, dtype=np.float64)


class Store:
    """Ring buffers of ``(time, value)`` per series name."""

    def __init__(self, points_per_series: int, max_series: int) -> None:
        if points_per_series < 1:
            raise ValueError(f"points_per_series must be >= 1, got {points_per_series}")
        if max_series < 1:
            raise ValueError(f"max_series must be >= 1, got {max_series}")
        self.points_per_series = points_per_series
        self.max_series = max_series
        #: Series evicted to make room for new names (least recently updated first).
        self.evictions = 0
        #: Values not stored because one snapshot carried more names than ``max_series``.
        self.dropped_values = 0
        self._rows: dict[str, int] = {}
        self._names: list[str | None] = []  # row -> name, so eviction finds its victim in O(1)
        self._free: list[int] = []
        self._tick = 0
        # The rows of the last snapshot's names, in its order: a tick normally carries the same names in
        # the same order as the one before, so its rows are reused instead of looked up name by name.
        self._layout: tuple[str, ...] = ()
        self._layout_rows = np.zeros(0, np.int64)
        self._kept = np.zeros(0, bool)
        self._times = np.zeros((0, points_per_series))
        self._values = np.zeros((0, points_per_series))
        self._pos = np.zeros(0, np.int64)
        self._count = np.zeros(0, np.int64)
        self._last = np.zeros(0, np.int64)
        self._allocate(min(max_series, 64))

    def _allocate(self, capacity: int) -> None:
        """Grow the slabs to ``capacity`` rows (copying the old rows); rows beyond the old end are free."""
        used = self._times.shape[0]
        shape = (capacity, self.points_per_series)
        times, values = np.zeros(shape), np.zeros(shape)
        pos, count = np.zeros(capacity, np.int64), np.zeros(capacity, np.int64)
        last = np.full(capacity, -1, np.int64)
        times[:used], values[:used] = self._times, self._values
        pos[:used], count[:used], last[:used] = self._pos, self._count, self._last
        self._times, self._values, self._pos, self._count, self._last = times, values, pos, count, last
        self._names.extend([None] * (capacity - used))
        self._free.extend(range(capacity - 1, used - 1, -1))  # pop() hands out low rows first

    def _row_for(self, name: str) -> int | None:
        """The row of a new series: a free one, a grown one, or the least recently updated (evicted)."""
        if not self._free and self._times.shape[0] < self.max_series:
            self._allocate(min(self.max_series, 2 * self._times.shape[0]))
        self._layout = ()  # a new name (and maybe an evicted one): the cached rows no longer hold
        if self._free:
            row = self._free.pop()
        else:
            row = int(np.argmin(self._last))
            if self._last[row] == self._tick:  # every row was written by this snapshot
                return None
            victim = self._names[row]
            if victim is not None:
                del self._rows[victim]
            self.evictions += 1
        self._pos[row] = 0
        self._count[row] = 0
        self._rows[name] = row
        self._names[row] = name
        return row

    def append(self, snapshot: Snapshot) -> None:
        """Record every value of ``snapshot`` at ``snapshot.now``. O(number of values)."""
        now = float(snapshot.now)
        if not math.isfinite(now):
            raise ValueError(f"snapshot time must be finite, got {snapshot.now}")
        if not snapshot.values:
            return
        self._tick += 1
        values = snapshot.values
        vals = np.fromiter(values.values(), np.float64, len(values))
        names = tuple(values)
        if names == self._layout:
            rows = self._layout_rows
        else:
            rows = self._rows_of(names)
            if rows.size == len(names):  # nothing dropped: the next snapshot with these names reuses them
                self._layout, self._layout_rows = names, rows
            else:
                vals = vals[self._kept]
        self._last[rows] = self._tick
        slots = self._pos[rows]
        self._times[rows, slots] = now
        self._values[rows, slots] = vals
        self._pos[rows] = (slots + 1) % self.points_per_series
        self._count[rows] = np.minimum(self._count[rows] + 1, self.points_per_series)

    def _rows_of(self, names: tuple[str, ...]) -> np.ndarray:
        """The row of every name, allocating rows for new ones; names that found no row are left out
        (``self._kept`` then says which were kept)."""
        rows = np.fromiter(map(self._rows.get, names, itertools.repeat(-1)), np.int64, len(names))
        new = np.flatnonzero(rows < 0)
        if new.size:  # rare: first sight of a name, possibly evicting another series
            self._last[rows[rows >= 0]] = self._tick  # rows in this snapshot are not eviction candidates
            for i in new.tolist():
                row = self._row_for(names[i])
                if row is None:
                    self.dropped_values += 1
                else:
                    rows[i] = row
                    self._last[row] = self._tick
            self._kept = rows >= 0
            rows = rows[self._kept]
        return rows

    def _ordered(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        count, pos = int(self._count[row]), int(self._pos[row])
        if count < self.points_per_series:
            return self._times[row, :count].copy(), self._values[row, :count].copy()
        order = np.r_[pos : self.points_per_series, 0:pos]
        return self._times[row, order], self._values[row, order]

    def window(self, name: str, since: float) -> tuple[np.ndarray, np.ndarray]:
        """``(times, values)`` of ``name`` observed at or after ``since``, oldest first, as copies.

        An unknown name gives two empty arrays: "no history" is not an error for a detector.
        """
        row = self._rows.get(name)
        if row is None:
            return _EMPTY.copy(), _EMPTY.copy()
        times, values = self._ordered(row)
        keep = times >= since
        return times[keep], values[keep]

    def latest(self, name: str) -> tuple[float, float] | None:
        """``(time, value)`` of the newest point of ``name``, or ``None`` when it has none."""
        row = self._rows.get(name)
        if row is None or self._count[row] == 0:
            return None
        slot = (int(self._pos[row]) - 1) % self.points_per_series
        return float(self._times[row, slot]), float(self._values[row, slot])

    def names(self) -> list[str]:
        """Names of the stored series, sorted."""
        return sorted(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (grows in steps up to ``max_series`` rows, then stays constant)."""
        arrays = (self._times, self._values, self._pos, self._count, self._last)
        return sum(a.nbytes for a in arrays)

"""A rotating Bloom filter: the response cache's admission test ("seen this key before?").

Why: most prompts are seen once. Caching on first sight fills the cache with one-off entries that push
out the few that repeat (the TinyLFU argument, Einziger et al. 2017). A Bloom filter remembers which
keys were seen, in a few bits per key, so an entry is admitted only on its second sighting.

Sizing, for ``n`` keys and a false-positive rate ``p``: ``m = -n ln p / (ln 2)^2`` bits and
``k = (m / n) ln 2`` hash functions. The ``k`` bit positions come from one BLAKE2b digest by double
hashing, ``h_i = h1 + i h2 mod m`` (Kirsch and Mitzenmacher 2006), which keeps ``p`` asymptotically.

A plain filter only fills up, and a full one says "seen" to everything. This one keeps two generations:
after ``capacity`` insertions the current filter becomes the previous one and a fresh filter takes its
place; a key counts as seen if either generation has it. So sightings are remembered for between one
and two generations of traffic, and the false-positive rate stays near ``2p`` at worst.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from numpy.typing import NDArray


class BloomFilter:
    """Two-generation Bloom filter over byte-string keys. Not thread-safe (the gate is one event loop)."""

    def __init__(self, capacity: int = 100_000, error_rate: float = 0.01) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 0 < error_rate < 1:
            raise ValueError(f"error_rate must be in (0, 1), got {error_rate}")
        self.capacity = capacity
        self.error_rate = error_rate
        self.num_bits = max(64, math.ceil(-capacity * math.log(error_rate) / math.log(2) ** 2))
        self.num_hashes = max(1, round(self.num_bits / capacity * math.log(2)))
        self._current = np.zeros(self.num_bits, dtype=np.bool_)
        self._previous = np.zeros(self.num_bits, dtype=np.bool_)
        self.count = 0  # insertions into the current generation
        self.rotations = 0

    def _positions(self, key: bytes) -> NDArray[np.int64]:
        digest = hashlib.blake2b(key, digest_size=16).digest()
        h1 = int.from_bytes(digest[:8], "little")
        h2 = int.from_bytes(digest[8:], "little") | 1  # odd, so the k positions differ
        return np.array([(h1 + i * h2) % self.num_bits for i in range(self.num_hashes)], dtype=np.int64)

    def __contains__(self, key: bytes) -> bool:
        pos = self._positions(key)
        return bool(self._current[pos].all() or self._previous[pos].all())

    def add(self, key: bytes) -> bool:
        """Record a sighting of ``key``; True when it was (probably) seen before this call."""
        pos = self._positions(key)
        seen = bool(self._current[pos].all() or self._previous[pos].all())
        if not self._current[pos].all():
            if self.count >= self.capacity:
                self._previous, self._current = self._current, np.zeros(self.num_bits, dtype=np.bool_)
                self.count = 0
                self.rotations += 1
            self._current[pos] = True
            self.count += 1
        return seen

    @property
    def nbytes(self) -> int:
        """Memory held by both generations (one byte per bit: numpy bools index fastest)."""
        return int(self._current.nbytes + self._previous.nbytes)

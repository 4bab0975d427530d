"""The rotating Bloom filter behind cache admission."""

from __future__ import annotations

import pytest

from agent.gate.bloom import BloomFilter


def test_first_sighting_is_new_and_second_is_seen() -> None:
    bloom = BloomFilter(1000, 0.01)
    assert bloom.add(b"prompt") is False
    assert bloom.add(b"prompt") is True and b"prompt" in bloom


def test_false_positive_rate_stays_near_target() -> None:
    bloom = BloomFilter(2000, 0.01)
    for i in range(2000):
        bloom.add(f"in-{i}".encode())
    false = sum(f"out-{i}".encode() in bloom for i in range(20_000))
    assert false / 20_000 < 0.02


def test_sizing_follows_the_formula() -> None:
    bloom = BloomFilter(1000, 0.01)
    assert 9500 <= bloom.num_bits <= 9600 and bloom.num_hashes == 7  # m = 9586, k = 6.6


def test_rotation_keeps_one_generation_and_forgets_the_one_before() -> None:
    bloom = BloomFilter(10, 0.01)
    bloom.add(b"old")
    for i in range(10):  # fills generation 1, rotates: "old" is in the previous generation
        bloom.add(f"a{i}".encode())
    assert bloom.rotations == 1 and b"old" in bloom
    for i in range(10):
        bloom.add(f"b{i}".encode())
    assert bloom.rotations == 2 and b"old" not in bloom


def test_bad_sizing_is_refused() -> None:
    with pytest.raises(ValueError, match="error_rate"):
        BloomFilter(10, 1.5)

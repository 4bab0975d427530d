"""The series-key memo under :func:`agent.collectors.exposition.parse_exposition`: what prometheus_client
made of each family header and ``name{labels}`` key, kept so that later scrapes of the same series only
read their values.

Scrape after scrape an engine sends the same series with new values, and most of the library's cost is in
parsing the ``name{labels}`` part (~15 µs a line, char by char). Kept apart from the exposition module
because it is a cache with its own bound and its own failure rule (anything it cannot take as is sends
the whole scrape down the library's plain path), not part of the parsing contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import _parse_value_and_timestamp, text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
"""Label pairs sorted by name: hashable, so it doubles as the series key."""

SENTINEL_PREFIXES: tuple[str, ...] = ("DCGM_", "dcgm_")
"""Families whose integer and float blank codes mean "no value" (DCGM's)."""


@dataclass(frozen=True, slots=True)
class Series:
    """What the library made of one ``name{labels}`` key, prepared once for the exposition builder."""

    name: str
    labels: Labels
    """All labels, sorted (the key of a counter or gauge series)."""
    series: Labels
    """Labels without ``le``, sorted (the key of a histogram series)."""
    le: str | None
    bound: float | None
    """``le`` as a number; ``None`` when absent or not a number."""
    part: str
    """``bucket``, ``count``, ``sum`` or ``""``: which histogram part the sample is."""
    sentinel: bool
    """The sample name is a DCGM one, whose blank codes are dropped."""


def series_of(name: str, labels: Mapping[str, str]) -> Series:
    rest = dict(labels)
    le = rest.pop("le", None)
    bound: float | None = None
    if le is not None:
        try:
            bound = float(le)
        except ValueError:
            bound = None
    if name.endswith("_bucket") and le is not None:
        part = "bucket"
    elif name.endswith("_count"):
        part = "count"
    elif name.endswith("_sum"):
        part = "sum"
    else:
        part = ""
    return Series(
        name,
        tuple(sorted(labels.items())),
        tuple(sorted(rest.items())),
        le,
        bound,
        part,
        name.startswith(SENTINEL_PREFIXES),
    )


def sample_value(rest: str) -> float:
    """The value after a series key, as the library's parser reads it (a timestamp is checked, then dropped).

    The common case, a bare number, is ``float()`` of it: what the library's ``_parse_value`` returns up to
    ``int``/``float`` (the builder converts to float anyway). Anything else goes to the library's own
    function, and whatever raises sends the scrape down the plain path.
    """
    text = rest.strip()
    if " " in text or "\t" in text or "_" in text:
        return _parse_value_and_timestamp(rest)[0]
    return float(text)


Family = tuple[str, str, list[tuple[Series, float]]]
"""A family read through the memo: its name, its type and its samples with their values."""


class SeriesMemo:
    """What the library parsed for each family header and each series key, reused on later scrapes.

    The memo keeps the library's result
    for each (header, ``name{labels}``) pair, already in the shape the builder needs (sorted label tuples,
    histogram part and bound), so a later scrape only reads values. Any line the memo cannot take as is
    sends the whole scrape down the plain path.
    Bounded: it is cleared when it grows past ``limit`` entries (label churn cannot grow it for ever).
    """

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self.headers: dict[str, tuple[str, str]] = {}
        #: header -> ``name{labels}`` -> what the library made of it (one dict per header: no tuple keys)
        self.series: dict[str, dict[str, Series]] = {}
        self.entries = 0

    def _bound(self) -> None:
        if self.entries + len(self.headers) > self.limit:
            self.series.clear()
            self.headers.clear()
            self.entries = 0

    def family(self, block: list[str]) -> Family | None:
        """The block read through the memo, or ``None`` when it needs the plain path."""
        header = "\n".join(line for line in block if line[0] == "#")
        if not header:
            return None
        meta = self.headers.get(header)
        if meta is None:
            parsed = list(text_string_to_metric_families(header))
            if len(parsed) != 1:
                return None
            self._bound()
            meta = self.headers[header] = (parsed[0].name, parsed[0].type)
        series = self.series.get(header)
        if series is None:
            series = self.series[header] = {}
        samples: list[tuple[Series, float]] = []
        for line in block:
            if line[0] == "#":
                continue
            brace = line.rfind("}")
            if brace >= 0:
                key, rest = line[: brace + 1], line[brace + 1 :]
            else:
                key, _, rest = line.partition(" ")
            if "#" in rest:
                return None
            known = series.get(key)
            if known is None:
                parsed = list(text_string_to_metric_families(f"{header}\n{key} 0"))
                if len(parsed) != 1 or parsed[0].name != meta[0] or len(parsed[0].samples) != 1:
                    return None
                self._bound()
                if header not in self.series:  # _bound() just cleared everything
                    series = self.series[header] = {}
                    self.headers[header] = meta
                sample = parsed[0].samples[0]
                known = series[key] = series_of(sample.name, sample.labels)
                self.entries += 1
            samples.append((known, sample_value(rest)))
        return meta[0], meta[1], samples

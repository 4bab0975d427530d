"""Token buckets per business line, and how a request is mapped to its line. Pure; time is passed in.

A bucket of capacity ``b`` refills at ``r`` per second (golang's ``rate.Limiter``: ``AllowN(now, n)``)::

    tokens(t) = min(b, tokens(t0) + r (t - t0))

A request takes 1 from the line's request bucket and, when a tokens-per-minute budget is set, its
estimated prompt + output tokens from the token bucket. A token charge larger than the whole bucket is
allowed from a full bucket and leaves it in debt (negative), so one huge request is served and then pays
for itself, instead of being refused forever. Once its answer says the tokens it used, the charge is
settled (:meth:`LineLimiter.settle`): reserved at admission, paid by use.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass

from agent.config import GateConfig, GateLineConfig
from agent.gate.admission import Priority


class TokenBucket:
    """A token bucket with the clock passed in. ``take`` returns 0 when granted, else the wait in seconds."""

    def __init__(self, rate_per_s: float, capacity: float, now: float) -> None:
        if rate_per_s <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be > 0")
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._tokens = capacity
        self._t = now

    def _refill(self, now: float) -> None:
        if now > self._t:  # a clock that steps back refills nothing rather than draining
            self._tokens = min(self.capacity, self._tokens + (now - self._t) * self.rate_per_s)
            self._t = now

    def tokens(self, now: float) -> float:
        self._refill(now)
        return self._tokens

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until ``n`` could be taken (0 when it can be now); does not take."""
        self._refill(now)
        need = min(n, self.capacity) - self._tokens
        return 0.0 if need <= 0 else need / self.rate_per_s

    def take(self, n: float, now: float) -> float:
        """Take ``n`` if available (see the module docstring for debt); else the wait in seconds."""
        wait = self.wait_for(n, now)
        if wait == 0.0:
            self._tokens -= n
        return wait

    def refund(self, n: float) -> None:
        """Give back tokens charged for a request that was not served after all (shed, expired)."""
        self._tokens = min(self.capacity, self._tokens + n)

    def settle(self, charged: float, used: float, now: float) -> None:
        """A request was charged ``charged`` and used ``used``: give back the rest, or take what it used
        beyond its charge (into debt, as a large request's charge may go)."""
        self._refill(now)
        self._tokens = min(self.capacity, self._tokens + charged - used)

    def carry_from(self, old: TokenBucket, now: float) -> None:
        """Start from what ``old`` holds at ``now`` (capped at this capacity, debt kept), not full: a
        config reload must not hand every line a fresh burst."""
        self._tokens = min(self.capacity, old.tokens(now))
        self._t = max(self._t, now)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The line limiter's answer: granted, or refused with a ``retry_after_s`` and a reason."""

    granted: bool
    retry_after_s: float = 0.0
    reason: str = ""
    limit: str = ""
    """Which bucket refused it: ``request_rate`` or ``token_rate`` (empty when granted)."""


class LineLimiter:
    """The request (and optional token) buckets of one business line: its configured rates and bursts
    times ``share``, this gate's part of them where several share them (agent/gate/peers.py)."""

    def __init__(self, name: str, cfg: GateLineConfig, now: float, share: float = 1.0) -> None:
        self.name = name
        self.priority = Priority[cfg.priority.upper()]
        self.max_priority = Priority[cfg.max_priority.upper()]
        self.max_in_flight_share = cfg.max_in_flight_share
        per_min = cfg.requests_per_min * share
        self.requests = TokenBucket(per_min / 60.0, per_min * cfg.burst_ratio, now)
        self.tokens: TokenBucket | None = None
        if cfg.tokens_per_min is not None:
            per_min = cfg.tokens_per_min * share
            self.tokens = TokenBucket(per_min / 60.0, per_min * cfg.burst_ratio, now)

    def class_of(self, asked: str | None) -> Priority:
        """The class a request asks for (the priority header; the line's own when it names none), up to
        the line's ``max_priority``: any client may send the header, and a tenant capped at normal must
        not take the high class's reserve."""
        return min(Priority.parse(asked, self.priority), self.max_priority)

    def admit(self, est_tokens: float, now: float) -> Verdict:
        wait_tokens = 0.0 if self.tokens is None else self.tokens.wait_for(est_tokens, now)
        wait_requests = self.requests.wait_for(1.0, now)
        if wait_requests > 0:
            why = f"business line {self.name!r} is over its request rate"
            return Verdict(False, wait_requests, why, "request_rate")
        if wait_tokens > 0:
            return Verdict(
                False, wait_tokens, f"business line {self.name!r} is over its token rate", "token_rate"
            )
        self.requests.take(1.0, now)
        if self.tokens is not None:
            self.tokens.take(est_tokens, now)
        return Verdict(True)

    def headers(self, now: float) -> tuple[tuple[str, str], ...]:
        """OpenAI's rate-limit headers for this line at ``now``, for clients that pace themselves by them:
        ``x-ratelimit-limit-requests`` (the bucket's size: a minute's rate times its burst),
        ``-remaining-requests`` (what it holds) and ``-reset-requests`` (until it is full again, as
        ``1s``, ``6m0s``, ``20ms``); the ``-tokens`` three too where the line has a token budget."""
        out: list[tuple[str, str]] = []
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is None:
                continue
            level = bucket.tokens(now)
            out.append((f"x-ratelimit-limit-{kind}", str(int(bucket.capacity))))
            out.append((f"x-ratelimit-remaining-{kind}", str(max(0, math.floor(level)))))
            out.append((f"x-ratelimit-reset-{kind}", duration((bucket.capacity - level) / bucket.rate_per_s)))
        return tuple(out)

    def refund(self, est_tokens: float) -> None:
        self.requests.refund(1.0)
        if self.tokens is not None:
            self.tokens.refund(est_tokens)

    def settle(self, charged: float, used: float, now: float) -> None:
        """Replace a served request's charge to the token budget (its estimate) by the tokens its answer
        says it used."""
        if self.tokens is not None:
            self.tokens.settle(charged, used, now)

    def carry_from(self, old: LineLimiter, now: float) -> None:
        """Keep ``old``'s bucket levels under this limiter's rates (a token budget new to the line
        starts full)."""
        self.requests.carry_from(old.requests, now)
        if self.tokens is not None and old.tokens is not None:
            self.tokens.carry_from(old.tokens, now)


class LineResolver:
    """Maps a request to its business line: API key map first (it cannot be spoofed by a header), then
    the line header when it names a configured line, else the default line."""

    def __init__(self, cfg: GateConfig) -> None:
        self.header = cfg.line_header
        self.default = cfg.default_line
        self.known = set(cfg.lines) | {cfg.default_line}
        self._keys = [(key.encode(), line) for key, line in cfg.api_keys.items()]

    def resolve(self, headers: Mapping[str, str]) -> str:
        return self.key_line(headers) or self.named_line(headers)

    def key_line(self, headers: Mapping[str, str]) -> str | None:
        """The line of the request's ``Authorization: Bearer`` key, or None when it has none of ours."""
        auth = headers.get("Authorization") or headers.get("authorization") or ""
        if self._keys and auth[:7].lower() == "bearer ":
            presented = auth[7:].strip().encode()
            for key, line in self._keys:  # constant-time per key: no timing oracle on key prefixes
                if hmac.compare_digest(presented, key):
                    return line
        return None

    def named_line(self, headers: Mapping[str, str]) -> str:
        """The line the line header names when it is one of ours, else the default line."""
        named = headers.get(self.header)
        if named is not None and named.strip() in self.known:
            return named.strip()
        return self.default


class LineLimits:
    """Every line's limiter, created on first use for lines the config does not list; ``share``: this
    gate's part of every line's rates (1/N where N gates share them, agent/gate/peers.py)."""

    def __init__(self, cfg: GateConfig, now: float, share: float = 1.0) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self._default = GateLineConfig(requests_per_min=cfg.default_requests_per_min)
        self._cfg = cfg
        self.share = share
        self._lines = {name: LineLimiter(name, line, now, share) for name, line in cfg.lines.items()}

    def get(self, name: str, now: float) -> LineLimiter:
        limiter = self._lines.get(name)
        if limiter is None:
            limiter = self._lines[name] = LineLimiter(name, self._default, now, self.share)
        return limiter

    def reconfigured(self, cfg: GateConfig, now: float, share: float | None = None) -> LineLimits:
        """The limits of ``cfg`` at ``share`` (this one's when None), each line's buckets carried over
        from this one's at ``now``: capped at a smaller bucket, never refilled by a larger one."""
        new = LineLimits(cfg, now, self.share if share is None else share)
        for name, old in self._lines.items():
            new.get(name, now).carry_from(old, now)
        return new


def duration(seconds: float) -> str:
    """A wait as OpenAI's rate-limit headers write one: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60.0:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


def retry_after_header(seconds: float) -> str:
    """``Retry-After`` takes whole seconds; round up, at least 1."""
    return str(max(1, math.ceil(seconds)))

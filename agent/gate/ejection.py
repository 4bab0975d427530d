"""Taking a hung upstream out of the gate's split, and letting it back in.

A hung engine (a tensor-parallel collective that never returns, a stuck kernel) keeps answering its
health check, so health alone keeps sending it its share of the traffic, and each request sent there
waits for ``gate.read_timeout_s``. :class:`StallEjector` judges an upstream by what it sends back:

* **Silence.** An upstream is silent while it holds streaming requests and sends no byte on any request.
  Only streams count: a stream gets a byte per token, while a long non-streamed answer is silent until it
  is complete. An engine with a long queue is not silent as long as it runs anything. The silence is the
  upstream's, not one request's: clients that give up (a 30 s timeout is common) and send again replace
  the held requests, and the silence goes on. It starts at the later of the upstream's last byte and the
  sending of the oldest stream it holds; it ends at its next byte, or when rounds (one per health
  interval) find it holding no stream for a quarter of ``after_s``: an upstream with no work is not
  silent, but clients retrying leave short gaps.
* **Ejection.** Silent for ``after_s``: the upstream is out (the health loop keeps it down instead of
  probing it). Out, it gets no new request while another upstream is healthy, so its held requests end
  (clients give up, or ``read_timeout_s``), and nothing could show that it is back. So, as Envoy's
  outlier detection does, it stays out for ``after_s`` times the number of consecutive ejections (at most
  ``max_out_s``) after it holds no more streams, then returns on probation: silent again, it is out again,
  for longer. Any byte from it, at any time, ends the ejection and resets the count.
* **Blind spots.** Silence is heard by the gate, so it counts only while the gate runs. When the gate
  itself goes unscheduled (its event loop blocked, or the whole node stalled), bytes the engine sent
  wait unread, and an engine stalled with the node sends none: either looks like a hang when the gate
  wakes. :class:`BlindWatch` notices such a stretch (``BLIND_AFTER_S`` or more) and every silence
  restarts when it ends. Seen on a 2-core VM running vLLM's CPU backend: the whole machine stopped
  scheduling for up to 5.9 s at a time (a separate process's 10 ms sleeps overslept as long), and each
  time every stream went silent for as long, plus up to 2.8 s.

Pure but for :class:`BlindWatch`'s beat: the gate passes in what it holds and the time; the health loop
acts on the verdicts.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PAUSE_SHARE = 0.25
"""A pause in an upstream's work (no stream held) shorter than this share of ``after_s`` does not end its
silence. Clients that time out at once retry within a second or two: seen live, a health round landing in
that gap reset a silence that had lasted 30 s."""


BLIND_AFTER_S = 1.0
"""The gate unscheduled this long or longer is blind: a blocked event loop or a stalled node, not a beat
late. Far above a healthy loop's lag (milliseconds; 107 ms was the worst, a full garbage collection at
256 streams, docs/gate.md) and far below any sane ``eject_stalled_s``."""

BEAT_S = 0.1
"""How often :meth:`BlindWatch.run` beats."""


class BlindWatch:
    """When the gate last woke from a blind spot, in the gate's clock.

    The beat runs on the event loop's own clock (``loop.time()``), so a test that moves the gate's clock
    by hand is not blind; the result is in the gate's clock, as the silences are. :meth:`awake_since`
    also checks the beat, so the health round that runs first after a blind spot (before the beat) does
    not judge across it."""

    def __init__(
        self, on_blind: Callable[[float], None] | None = None, after_s: float = BLIND_AFTER_S
    ) -> None:
        self.after_s = after_s
        self._on_blind = on_blind
        self._beat: float | None = None  # loop.time() of the last beat or check
        self._awake_since = -math.inf

    def awake_since(self, loop_now: float, clock_now: float) -> float:
        """The gate-clock time silences may count from: the end of the last blind spot (``-inf``: none).
        ``loop_now`` is ``loop.time()``, ``clock_now`` the gate's clock, both read now."""
        if self._beat is not None and loop_now - self._beat >= self.after_s:
            self._awake_since = clock_now
            if self._on_blind is not None:
                self._on_blind(loop_now - self._beat)
        self._beat = loop_now
        return self._awake_since

    async def run(self, clock: Callable[[], float], beat_s: float = BEAT_S) -> None:
        """Beat every ``beat_s`` until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            self.awake_since(loop.time(), clock())
            await asyncio.sleep(beat_s)


class UpstreamStalled(Exception):
    """Raised into the relay of a stream whose upstream hung (the gate ends it with an error event)."""


@dataclass(slots=True)
class _Ejection:
    count: int
    """Consecutive ejections with no byte from the upstream in between."""
    at: float
    """When the current silence was judged a hang."""
    until: float | None = None
    """When it may return; None while it still holds silent streams."""


class StallEjector:
    """Per upstream: its silence, its ejection, and the verdicts for the health loop."""

    def __init__(
        self, after_s: float, max_out_s: float = 300.0, on_eject: Callable[[str], None] | None = None
    ) -> None:
        self.after_s = after_s
        self.max_out_s = max(max_out_s, after_s)
        self._on_eject = on_eject
        self._heard: dict[str, float] = {}  # last byte of a request no longer held
        self._silent_since: dict[str, float] = {}
        self._idle_since: dict[str, float] = {}  # first round that found a silent upstream holding nothing
        self._ejections: dict[str, _Ejection] = {}

    def hung(self, upstream: str, now: float) -> bool:
        """True while ``upstream`` holds streams and has been silent ``after_s`` (not merely held out)."""
        since = self._silent_since.get(upstream)
        return self.after_s > 0 and since is not None and now - since >= self.after_s

    def heard(self, upstream: str, at: float) -> None:
        """A request that ``upstream`` answered has ended; its last byte came ``at``."""
        if at > self._heard.get(upstream, -math.inf):
            self._heard[upstream] = at

    def verdicts(
        self, held: Iterable[tuple[str, float, float | None]], now: float, awake_since: float = -math.inf
    ) -> dict[str, str]:
        """Upstreams to keep out now, with why. ``held``: one ``(upstream, sent_at, heard_at)`` per
        streaming request held, ``heard_at`` its last byte (None before its first). ``awake_since``: the
        end of the gate's last blind spot (:class:`BlindWatch`); no silence counts from before it.
        Empty when off."""
        if self.after_s <= 0:
            self._silent_since.clear()
            self._idle_since.clear()
            self._ejections.clear()
            return {}
        streams: dict[str, tuple[int, float, float]] = {}  # name -> (count, last byte, oldest quiet since)
        for name, sent_at, heard_at in held:
            count, heard, quiet = streams.get(name, (0, self._heard.get(name, -math.inf), math.inf))
            if heard_at is None:
                quiet = min(quiet, sent_at)
            else:
                heard, quiet = max(heard, heard_at), min(quiet, heard_at)
            streams[name] = (count + 1, heard, quiet)
        for name in list(self._silent_since):
            if name in streams:
                self._idle_since.pop(name, None)
                continue
            idle_since = self._idle_since.setdefault(name, now)
            if now - idle_since >= self.after_s * PAUSE_SHARE:  # no work a while: no silence to judge
                del self._silent_since[name], self._idle_since[name]
        for name, ejection in list(self._ejections.items()):
            heard = streams[name][1] if name in streams else self._heard.get(name, -math.inf)
            if heard > ejection.at:  # it spoke since: not hung (any more)
                del self._ejections[name]
        out: dict[str, str] = {}
        for name, (count, heard, quiet) in streams.items():
            since = self._silent_since.get(name)
            if since is None or heard > since or awake_since > since:  # new, ended by a byte, or unseen
                since = self._silent_since[name] = max(heard, quiet, awake_since)
            if now - since < self.after_s:
                continue
            previous = self._ejections.get(name)
            if previous is None or (previous.until is not None and previous.until <= now):
                current = self._ejections[name] = _Ejection((previous.count if previous else 0) + 1, now)
                if self._on_eject is not None:
                    self._on_eject(name)
            else:
                current = previous
            current.until = None
            out[name] = f"stalled: {count} streaming request(s) held, no byte from it for {now - since:.0f} s"
        for name, ejection in self._ejections.items():
            if name in out:
                continue
            if ejection.until is None:  # its silent streams are gone: out a while longer, then probation
                ejection.until = now + min(self.after_s * ejection.count, self.max_out_s)
            if now < ejection.until:
                out[name] = (
                    f"stalled (no byte since it was judged hung {now - ejection.at:.0f} s ago): out for "
                    f"{ejection.until - now:.0f} s more, ejection {ejection.count} in a row"
                )
        return out

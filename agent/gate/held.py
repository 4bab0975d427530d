"""The requests the gate has sent to an upstream and not finished: which of them will miss the SLO, and
which a hung upstream holds and must give back.

:class:`~agent.gate.proxy.Gate` notes each request here while it is at an upstream (:meth:`HeldRequests.sent`
to :meth:`HeldRequests.done`), the response it relays and the send still waiting for response headers.
Two views read that:

* :meth:`HeldRequests.late`: per upstream, the requests whose answer will miss the latency SLO
  whatever comes next (the canary judges a slow candidate by them within its step);
* :meth:`HeldRequests.stalled`: the upstreams to keep out of the split as hung
  (:class:`~agent.gate.ejection.StallEjector`'s verdicts plus the sidecar's ``engine_stall`` finding),
  and, with ``cut_stalled_streams``, taking their requests back from them.

No I/O of its own: taking a request back is setting an exception on the relayed response's stream, or
expiring the timeout its send waits under, and the gate's request path acts on that.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

import aiohttp

from agent.gate.ejection import StallEjector, UpstreamStalled
from agent.gate.openai import NON_GENERATING_PATHS
from agent.gate.records import RequestRecord, whole_answer_budget


class HeldRequests:
    """What the gate's upstreams hold now, by ``id`` of each request's record."""

    def __init__(self, ejector: StallEjector) -> None:
        self.ejector = ejector
        #: requests sent to an upstream and not yet finished: the upstream's name, the record and whether
        #: it streams
        self.at_upstream: dict[int, tuple[str, RequestRecord, bool]] = {}
        #: the upstream responses being relayed
        self.relaying: dict[int, aiohttp.ClientResponse] = {}
        #: the sends still waiting for the upstream's response headers
        self.sending: dict[int, asyncio.Timeout] = {}
        #: upstreams out of the split whose hang a started stream proved, and when
        self.proven_hung: dict[str, float] = {}
        #: upstreams the engine_stall detector finds hung, and its summary (:meth:`set_engine_stalled`)
        self.engine_stalled: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.at_upstream)

    def sent(self, record: RequestRecord, upstream: str, streams: bool, now: float) -> None:
        """``record`` goes to ``upstream`` now (a first try, or again after one was taken back)."""
        if record.held_s is None:  # its first send: what the gate held it for, its queue wait aside
            record.held_s = max(0.0, now - record.arrived - record.queue_wait_s)
        record.sent_at, record.heard_at, record.abandoned = now, None, ""
        key = id(record)
        self.at_upstream[key] = (upstream, record, streams)
        self.relaying.pop(key, None)  # the answer of the upstream it was taken back from

    def unanswered(self, upstream: str) -> int:
        """Requests at ``upstream`` that have had no byte of its answer yet."""
        held = self.at_upstream.values()
        return sum(1 for name, record, _ in held if name == upstream and record.heard_at is None)

    def done(self, record: RequestRecord) -> None:
        """``record`` has left its upstream: answered, failed or given up."""
        self.at_upstream.pop(id(record), None)
        self.relaying.pop(id(record), None)
        if record.upstream and record.heard_at is not None:
            self.ejector.heard(record.upstream, record.heard_at)

    def late(
        self,
        slo: tuple[float, float],
        now: float,
        by_priority: Mapping[str, tuple[float, float]] | None = None,
    ) -> dict[str, int]:
        """Per upstream, the requests it holds whose answer will miss ``slo`` (TTFT, mean ITL) whatever
        comes next: no first token yet and past the TTFT SLO, or streaming for so long since the first
        token that the mean ITL would exceed the ITL SLO even if every token still allowed
        (``max_tokens``) came at once. A request answered in one piece is late once it is past the time
        a stream of ``max_tokens`` meeting both targets would have ended
        (:func:`~agent.gate.records.whole_answer_budget`, how its answer will be judged).

        Their verdict is known before they finish: each will be an SLO-bad answer. The canary counts them
        with its candidate's answers, so an upstream too slow to answer within a step is judged in that
        step, not a step later as missing data (seen live: fp8 slowed 30x passed its 5% step and was
        rolled back only at 25%). A candidate with a fast first token and slow decoding is seen the same
        way. A request whose class has its own targets (``by_priority``) is judged by them, as its answer
        will be.
        """
        late: dict[str, int] = {}
        for name, record, streams in self.at_upstream.values():
            own = slo if by_priority is None else by_priority.get(record.priority, slo)
            ttft_slo, itl_slo = own
            if not streams:  # to be answered in one piece: late past the budget of its longest answer
                missed = now - record.arrived > self._whole_budget(record, own)
            elif record.ttft_s is None:
                missed = now - record.arrived > ttft_slo
            else:  # the ITL SLO is on the mean over the answer, as GateStats.missed_slo judges it
                decoding_s = now - record.arrived - record.ttft_s
                longest = record.max_tokens / max(1, record.choices)  # the sequences decode side by side
                missed = longest > 1 and decoding_s > itl_slo * (longest - 1)
            if missed:
                late[name] = late.get(name, 0) + 1
        return late

    @staticmethod
    def _whole_budget(record: RequestRecord, slo: tuple[float, float]) -> float:
        """How long a request answered in one piece may take before it must miss ``slo``: a pooling
        or embedding request's answer is its first output (the TTFT SLO); a generation's is the budget of
        ``max_tokens``, and without one it can always be long (never provably late while held)."""
        if record.path in NON_GENERATING_PATHS:
            return slo[0]
        longest = record.max_tokens / max(1, record.choices)
        return whole_answer_budget(slo, longest) if longest > 0 else math.inf

    def set_engine_stalled(self, upstream: str, why: str | None) -> None:
        """The sidecar's ``engine_stall`` finding on the engine behind ``upstream``: its summary while it
        stands, None once it does not (see :meth:`agent.gate.proxy.Gate.set_engine_stalled`)."""
        if why is None:
            self.engine_stalled.pop(upstream, None)
        else:
            self.engine_stalled[upstream] = why

    def stalled(self, now: float, awake: float, *, cut: bool) -> dict[str, str]:
        """Upstreams to keep out of the split as hung, with why; ``awake``: no silence counts from before
        it (:class:`~agent.gate.ejection.BlindWatch`). Empty when ``eject_stalled_s`` is 0.

        With ``cut`` (``cut_stalled_streams``), the requests a hung upstream holds are taken from it:

        * the streams it had started and then left without a byte for ``eject_stalled_s`` end here with
          an OpenAI-shaped error event, instead of waiting for ``read_timeout_s`` (300 s): their clients
          have had the headers and some tokens, so an error event is the only way to tell them;
        * once one such stream proves the hang, the requests it has not answered at all (a stream's
          first token, a whole non-streamed answer) are sent again to a healthy upstream: their clients
          have had nothing yet, so they do not notice. Without that proof they are left alone: a very
          long prompt keeps a healthy engine silent as long, but it does not stop a started stream,
          since engines interleave a prefill with the decode steps of the others (chunked prefill).
          The sidecar's ``engine_stall`` finding on the upstream's engine is proof too.
        """
        held = (
            (name, record.sent_at, record.heard_at)
            for name, record, streams in self.at_upstream.values()
            if streams
        )
        verdicts = self.ejector.verdicts(held, now, awake)
        stalled = self.engine_stalled if self.ejector.after_s > 0 else {}
        for name, why in stalled.items():
            verdicts.setdefault(name, f"{why} (the sidecar's engine_stall detector)")
        for name in set(self.proven_hung) - set(verdicts):  # back in the split: a new hang needs new proof
            del self.proven_hung[name]
        hung = {name for name in verdicts if self.ejector.hung(name, now)} | set(stalled)  # not merely out
        if not cut or not (hung or self.proven_hung):
            return verdicts
        for name in stalled:  # the detector's finding is the proof
            self.proven_hung.setdefault(name, now)
        self._cut_silent_streams(hung, now, awake)
        self._take_back_unanswered(now, awake)
        return verdicts

    def _cut_silent_streams(self, hung: set[str], now: float, awake: float) -> None:
        """End the relayed streams of ``hung`` upstreams silent for ``eject_stalled_s``: proof of the hang."""
        after = self.ejector.after_s
        for key, (name, record, _) in list(self.at_upstream.items()):
            up, heard = self.relaying.get(key), record.heard_at
            if name not in hung or up is None or heard is None or record.abandoned:
                continue  # not a relayed stream, or one with no first byte yet, or ended already
            if now - max(heard, awake) >= after:
                record.abandoned = f"{name} stalled: no byte for {now - heard:.0f} s"
                up.content.set_exception(UpstreamStalled(record.abandoned))
                self.proven_hung.setdefault(name, now)

    def _take_back_unanswered(self, now: float, awake: float) -> None:
        """Take back, from upstreams proven hung, the requests they have sent no byte of."""
        after = self.ejector.after_s
        for key, (name, record, _) in list(self.at_upstream.items()):
            proven = self.proven_hung.get(name)
            if proven is None or record.heard_at is not None or record.abandoned:
                continue
            if record.sent_at > proven and now - max(record.sent_at, awake) < after:
                # sent after the proof (the only upstream, tried anyway): it may have recovered, and this
                # one may be a long prompt; it is judged as the upstream was, after eject_stalled_s
                continue
            record.abandoned = f"{name} stalled: no byte for {now - record.sent_at:.0f} s"
            up, sending = self.relaying.get(key), self.sending.get(key)
            if up is not None:
                up.content.set_exception(UpstreamStalled(record.abandoned))
            elif sending is not None:  # still waiting for the response headers
                sending.reschedule(asyncio.get_running_loop().time())

"""HeldRequests on its own: which held requests will miss the SLO, and which verdicts a hang gives.

The request path around it (sending, relaying, taking back) is tested through the real gate in
test_proxy.py and test_ejection.py; these are the views' rules without a socket.
"""

from __future__ import annotations

from agent.gate.ejection import StallEjector
from agent.gate.held import HeldRequests
from agent.gate.records import RequestRecord

SLO = (2.0, 0.1)  # TTFT 2 s, mean ITL 100 ms


def _record(arrived: float, max_tokens: float = 11.0) -> RequestRecord:
    record = RequestRecord("default", "normal", "/v1/completions", 10.0, arrived)
    record.max_tokens = max_tokens
    return record


def test_late_counts_a_missed_first_token_and_a_stream_too_slow_to_make_its_mean_itl() -> None:
    held = HeldRequests(StallEjector(0.0))
    waiting, streaming, plain = _record(0.0), _record(0.0), _record(0.0)
    held.sent(waiting, "primary", True, 0.0)
    held.sent(streaming, "fp8", True, 0.0)
    held.sent(plain, "fp8", False, 0.0)
    streaming.ttft_s = plain.ttft_s = 0.5
    # 10 tokens still allowed at 0.1 s each after the first (at 0.5 s): the stream may decode until 1.5 s
    assert held.late(SLO, 1.5) == {}
    assert held.late(SLO, 1.6) == {"fp8": 1}  # the non-streamed answer has no ITL to miss
    assert held.late(SLO, 2.1) == {"primary": 1, "fp8": 1}  # no first token within the TTFT SLO
    held.done(waiting)
    assert held.late(SLO, 2.1) == {"fp8": 1}
    assert len(held) == 2


def test_a_request_answered_in_one_piece_is_late_only_past_the_budget_of_its_longest_answer() -> None:
    """The budget is where a stream of ``max_tokens`` meeting both targets would end: 2 + 10 x 0.1 = 3 s
    for 11 tokens. A generation with no ``max_tokens`` may always be long; an embedding is one output."""
    held = HeldRequests(StallEjector(0.0))
    bounded, unbounded = _record(0.0), _record(0.0, max_tokens=0.0)
    pooling = RequestRecord("default", "normal", "/v1/embeddings", 10.0, 0.0)
    for record in (bounded, unbounded, pooling):
        held.sent(record, "primary", False, 0.0)
    assert held.late(SLO, 1.9) == {}
    assert held.late(SLO, 2.9) == {"primary": 1}  # only the embedding: past the 2 s TTFT SLO
    assert held.late(SLO, 3.1) == {"primary": 2}
    assert held.late(SLO, 1e6) == {"primary": 2}  # the unbounded one is never provably late


def test_a_request_sent_again_starts_afresh_and_done_tells_the_ejector_its_last_byte() -> None:
    ejector = StallEjector(10.0)
    held = HeldRequests(ejector)
    record = _record(0.0)
    held.sent(record, "primary", True, 1.0)
    record.heard_at, record.abandoned = 3.0, "primary stalled"
    held.sent(record, "fp8", True, 4.0)  # taken back and sent to the next upstream
    assert (record.sent_at, record.heard_at, record.abandoned) == (4.0, None, "")
    assert [name for name, _, _ in held.at_upstream.values()] == ["fp8"]
    record.upstream, record.heard_at = "fp8", 5.0
    held.done(record)
    assert len(held) == 0
    # fp8's last byte (5.0) counts: a stream it has held since 3.0 with no byte is silent from 5.0 on
    quiet = _record(3.0)
    held.sent(quiet, "fp8", True, 3.0)
    assert held.stalled(14.9, 0.0, cut=False) == {}
    assert "no byte from it for 10 s" in held.stalled(15.0, 0.0, cut=False)["fp8"]


def test_the_engine_stall_finding_is_a_verdict_only_while_ejection_is_on_and_until_it_clears() -> None:
    on, off = HeldRequests(StallEjector(60.0)), HeldRequests(StallEjector(0.0))
    for held in (on, off):
        held.set_engine_stalled("primary", "engine hung: no token for 60 s")
    assert on.stalled(1.0, 0.0, cut=False) == {
        "primary": "engine hung: no token for 60 s (the sidecar's engine_stall detector)"
    }
    assert off.stalled(1.0, 0.0, cut=False) == {}
    on.set_engine_stalled("primary", None)
    assert on.stalled(2.0, 0.0, cut=False) == {}


def test_with_cut_the_finding_proves_the_hang_and_a_request_with_no_byte_yet_is_taken_back() -> None:
    held = HeldRequests(StallEjector(60.0))
    unanswered = _record(0.0)
    held.sent(unanswered, "primary", False, 0.0)
    held.set_engine_stalled("primary", "engine hung")
    held.stalled(1.0, 0.0, cut=False)
    assert unanswered.abandoned == ""  # without cut_stalled_streams nothing is taken back
    held.stalled(1.0, 0.0, cut=True)
    assert held.proven_hung == {"primary": 1.0}
    assert unanswered.abandoned == "primary stalled: no byte for 1 s"
    held.set_engine_stalled("primary", None)
    held.stalled(2.0, 0.0, cut=True)
    assert held.proven_hung == {}  # back in the split: a new hang needs new proof

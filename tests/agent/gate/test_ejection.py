"""StallEjector alone, in virtual time: when a silent upstream goes out, how long it stays out, and what
brings it back (agent/gate/ejection.py). The gate around it is tested in test_proxy.py."""

from __future__ import annotations

import math

from agent.gate.ejection import BLIND_AFTER_S, BlindWatch, StallEjector


def test_silence_is_judged_on_held_streams_and_ended_by_any_byte() -> None:
    ejector = StallEjector(60.0)
    assert ejector.verdicts([], 1000.0) == {}  # holds nothing: no verdict, however long since a byte
    ejector.heard("primary", 900.0)  # a request it answered ended; its last byte came at 900
    assert ejector.verdicts([("primary", 1000.0, None)], 1000.0) == {}  # just sent: silent since 1000
    assert ejector.verdicts([("primary", 1000.0, None)], 1059.0) == {}
    assert set(ejector.verdicts([("primary", 1000.0, None)], 1060.0)) == {"primary"}
    # another stream it holds got a byte at 1061: not silent any more, and no longer out
    assert ejector.verdicts([("primary", 1000.0, None), ("primary", 1030.0, 1061.0)], 1062.0) == {}


def test_out_for_longer_after_each_ejection_in_a_row_up_to_the_cap() -> None:
    ejected: list[str] = []
    ejector = StallEjector(60.0, max_out_s=150.0, on_eject=ejected.append)
    t, outs = 0.0, []
    for _ in range(4):
        verdict = ejector.verdicts([("fp8", t, None)], t + 60.0)  # tried on probation, silent 60 s
        assert verdict["fp8"].startswith("stalled: 1 streaming request(s) held")
        t += 60.0
        assert "fp8" in ejector.verdicts([], t)  # its requests gave up: out a while, holding nothing
        back = t
        while "fp8" in ejector.verdicts([], back):
            back += 1.0
        outs.append(back - t)
        t = back
    assert outs == [60.0, 120.0, 150.0, 150.0]  # 60 s x ejections in a row, at most max_out_s
    assert ejected == ["fp8"] * 4  # servepilot_gate_upstream_ejections_total counts each


def test_a_byte_resets_the_count_and_zero_turns_it_off() -> None:
    ejector = StallEjector(10.0)
    assert "a" in ejector.verdicts([("a", 0.0, None)], 10.0)
    assert "a" in ejector.verdicts([], 11.0)  # out until 21
    assert ejector.verdicts([], 21.0) == {}  # probation
    assert "a" in ejector.verdicts([("a", 21.0, None)], 31.0)  # silent again: ejection 2
    ejector.heard("a", 32.0)  # that request got its answer after all
    assert ejector.verdicts([], 33.0) == {}  # back at once
    verdict = ejector.verdicts([("a", 40.0, None)], 50.0)
    assert verdict == {"a": "stalled: 1 streaming request(s) held, no byte from it for 10 s"}
    assert "out for 10 s more, ejection 1 in a row" in ejector.verdicts([], 50.0)["a"]  # counted anew
    ejector.after_s = 0.0
    assert ejector.verdicts([("a", 0.0, None)], 1e6) == {}
    ejector.after_s = 10.0
    assert ejector.verdicts([], 1e6) == {}  # turning it off forgot the ejection


def test_a_short_pause_between_requests_does_not_end_the_silence_and_a_long_one_does() -> None:
    """Seen live: six clients timed out at about the same moment and sent again within a second; a
    health round in that gap restarted a 30 s silence, and the hung upstream stayed in 30 s longer."""
    ejector = StallEjector(60.0)  # a pause of 15 s or more ends a silence
    assert ejector.verdicts([("a", 0.0, None)], 30.0) == {}
    assert ejector.verdicts([], 30.5) == {}  # every client timed out; none has sent again yet
    assert ejector.verdicts([("a", 31.0, None)], 45.0) == {}
    assert "a" in ejector.verdicts([("a", 31.0, None)], 60.0)  # silent since 0, not since 31
    fresh = StallEjector(60.0)
    assert fresh.verdicts([("a", 0.0, None)], 30.0) == {}
    assert fresh.verdicts([], 31.0) == {}
    assert fresh.verdicts([], 46.0) == {}  # holding nothing for 15 s: that silence is over
    assert fresh.verdicts([("a", 50.0, None)], 100.0) == {}  # silent since 50 only
    assert "a" in fresh.verdicts([("a", 50.0, None)], 110.0)


def test_no_silence_counts_from_before_the_gate_woke_from_a_blind_spot() -> None:
    """Silent 59 s, then the gate itself was unscheduled and woke at 1059: the last 59 s are not the
    upstream's for sure (bytes may wait unread, or the engine stalled with the node), so it restarts."""
    ejector = StallEjector(60.0)
    assert ejector.verdicts([("a", 1000.0, None)], 1059.0) == {}
    assert ejector.verdicts([("a", 1000.0, None)], 1060.0, awake_since=1059.0) == {}
    assert ejector.verdicts([("a", 1000.0, None)], 1118.0, awake_since=1059.0) == {}
    verdict = ejector.verdicts([("a", 1000.0, None)], 1119.0, awake_since=1059.0)
    assert verdict == {"a": "stalled: 1 streaming request(s) held, no byte from it for 60 s"}
    fresh = StallEjector(60.0)  # a blind spot before the silence began changes nothing
    assert "a" in fresh.verdicts([("a", 1000.0, 1001.0)], 1061.0, awake_since=500.0)


def test_the_blind_watch_reports_a_gap_in_its_beat_in_the_gates_clock() -> None:
    """Beats on the loop's clock; what it returns is in the gate's clock, which a test may move by hand
    without the gate going blind."""
    blind: list[float] = []
    watch = BlindWatch(on_blind=blind.append)
    assert watch.awake_since(10.0, 500.0) == -math.inf  # the first beat
    assert watch.awake_since(10.1, 900.0) == -math.inf  # the gate's clock jumped; the loop's did not
    assert watch.awake_since(10.1 + BLIND_AFTER_S - 0.01, 901.0) == -math.inf  # late, not blind
    assert watch.awake_since(15.0, 906.0) == 906.0  # 3.9 s unscheduled
    assert watch.awake_since(15.1, 906.1) == 906.0
    assert len(blind) == 1 and math.isclose(blind[0], 15.0 - (10.1 + BLIND_AFTER_S - 0.01))

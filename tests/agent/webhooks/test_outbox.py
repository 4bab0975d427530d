from __future__ import annotations

from pathlib import Path

import pytest

from agent.webhooks.alerts import Alert
from agent.webhooks.outbox import Message, Outbox, OutboxError


def _msg(i: int, sink: str = "generic", at: float = 0.0) -> Message:
    return Message(f"msg_{i}", sink, at + i, at + i, 0, b'{"i":%d}' % i)


def test_messages_survive_reopening_the_file(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "q.sqlite")
    box.put(_msg(1))
    box.close()
    reopened = Outbox(tmp_path / "q.sqlite")
    assert [m.id for m in reopened.due(now=10.0)] == ["msg_1"]
    assert reopened.due(now=10.0)[0].body == b'{"i":1}'


def test_the_same_id_is_stored_once(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "q.sqlite")
    assert box.put(_msg(1)) == (True, 0)
    assert box.put(_msg(1)) == (False, 0)
    assert box.pending("generic") == 1


def test_due_respects_next_attempt_time(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "q.sqlite")
    box.put(_msg(1))
    box.retry_at("msg_1", 100.0, "HTTP 503")
    assert box.due(now=99.0) == []
    [msg] = box.due(now=100.0)
    assert msg.attempts == 1 and msg.last_error == "HTTP 503"


def test_a_message_waits_behind_the_older_one_of_its_sink(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "q.sqlite")
    box.put(_msg(1))
    box.put(_msg(2))
    box.put(_msg(3, "alertmanager"))
    box.retry_at("msg_1", 100.0, "connection refused")
    # msg_2 is due but msg_1, stored before it, is not: only the other sink's queue moves
    assert [m.id for m in box.due(now=50.0)] == ["msg_3"]
    box.remove("msg_3")
    assert box.next_due_at() == 100.0  # not msg_2's time: a wake-up then would find nothing to send
    assert [m.id for m in box.due(now=100.0)] == ["msg_1", "msg_2"]


def test_full_queue_evicts_the_oldest_of_that_sink(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "q.sqlite", max_pending=3)
    box.put(_msg(0, "alertmanager"))
    evicted = [box.put(_msg(i))[1] for i in range(1, 5)]
    assert evicted == [0, 0, 0, 1]
    assert [m.id for m in box.due(now=100.0) if m.sink == "generic"] == ["msg_2", "msg_3", "msg_4"]
    assert box.pending("alertmanager") == 1


def test_active_alerts_are_stored_and_replaced(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "q.sqlite")
    a = Alert({"alertname": "A"}, {}, 1.0)
    b = Alert({"alertname": "B"}, {}, 2.0)
    box.save_active([a, b])
    box.save_active([b])
    assert box.load_active() == [b]


def test_unopenable_path_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutboxError, match="cannot open webhook outbox"):
        Outbox(tmp_path / "file" / "q.sqlite")

"""``--log-format json``: each record one JSON line, a traceback too, and nothing else on the log."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from agent.engines.launcher import free_port
from agent.logs import json_formatter

ROOT = Path(__file__).resolve().parents[2]
RFC3339_UTC_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def test_a_record_with_a_traceback_is_one_json_line() -> None:
    try:
        raise ValueError("bad reading")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("agent.loop", logging.ERROR, __file__, 1, "tick %d failed", (7,), exc_info)
    record.upstream = "primary"  # what a call passes in extra=
    line = json_formatter().format(record)
    assert "\n" not in line
    fields = json.loads(line)
    assert fields["level"] == "ERROR" and fields["logger"] == "agent.loop"
    assert fields["message"] == "tick 7 failed" and fields["upstream"] == "primary"
    assert "Traceback" in fields["exc_info"] and "ValueError: bad reading" in fields["exc_info"]
    assert RFC3339_UTC_MS.match(fields["time"])
    assert fields["time"][:19] == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))


def test_a_warning_of_a_library_is_a_record_too() -> None:
    script = (
        "import argparse, warnings; from agent import logs; "
        "logs.setup(argparse.Namespace(log_level='info', log_format='json')); "
        "warnings.warn('deprecated knob', DeprecationWarning, stacklevel=1)"
    )
    run = subprocess.run(
        [sys.executable, "-W", "always", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    [line] = run.stderr.splitlines()
    record = json.loads(line)
    assert record["logger"] == "py.warnings" and "DeprecationWarning: deprecated knob" in record["message"]


def test_the_gate_writes_nothing_but_json_lines() -> None:
    gate = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "gate", "--upstream", f"http://127.0.0.1:{free_port()}",
         "--port", str(free_port()), "--metrics-port", "0", "--log-level", "info", "--log-format", "json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    guard = threading.Timer(30, gate.kill)  # a gate that never logs the dead upstream must not hang the test
    guard.start()
    lines: list[str] = []
    try:
        assert gate.stdout is not None
        for line in gate.stdout:
            lines.append(line)
            if "is down" in line:  # its health check found the upstream dead: a warning was written
                break
        gate.send_signal(signal.SIGTERM)
        lines += gate.stdout.readlines()
        assert gate.wait(20) == 0, "".join(lines)
    finally:
        guard.cancel()
        if gate.poll() is None:
            gate.kill()
    records = [json.loads(line) for line in lines]  # a line that is not JSON fails here
    assert any(r["level"] == "WARNING" and "is down" in r["message"] for r in records), lines
    assert any(r["message"].startswith("servepilot gate: http://") for r in records), lines
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)

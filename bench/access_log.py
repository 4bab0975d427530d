"""What the gate's access log (``gate.access_log``) costs per request: the CPU of building and queueing a
line on the event loop, and of writing it on the writer thread, both counted (``time.process_time``).

Lines are written to a file in a temporary folder, for ``--lines`` requests with a full record (an
answered stream: line, priority, upstream, tokens, TTFT, request id). Run ``python -m bench.access_log``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.gate.access_log import QUEUE_LINES, AccessLog
from agent.gate.records import RequestRecord


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lines", type=int, default=QUEUE_LINES // 2, help="requests to log (fewer than the queue holds)"
    )
    args = parser.parse_args()
    record = RequestRecord(
        "search",
        "normal",
        "/v1/chat/completions",
        812.0,
        0.0,
        upstream="primary",
        output_tokens=256,
        ttft_s=0.21,
    )
    headers = {"X-Request-Id": "0f8c2d1e-5b7a-4c3e-9a61-2f4d8b9e7c10"}
    with tempfile.TemporaryDirectory() as folder:
        registry = CollectorRegistry()
        log = AccessLog(str(Path(folder) / "access.jsonl"), registry)
        log.start()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(args.lines):
            log.write(
                method="POST", path="/v1/chat/completions", status=200, held_s=4.2, headers=headers,
                remote="10.0.3.7", record=record, bucket="le1k",
            )  # fmt: skip
        queued = (time.perf_counter() - wall) / args.lines
        log.stop()  # every line written
        cpu = (time.process_time() - cpu) / args.lines
        written = (Path(folder) / "access.jsonl").read_text(encoding="utf-8").splitlines()
    dropped = registry.get_sample_value("servepilot_gate_access_log_dropped_total")
    print(f"{len(written)} lines of {len(written[0]) + 1} bytes written, {dropped:.0f} dropped")
    print(f"on the event loop: {queued * 1e6:.1f} us per request (build and queue the line)")
    print(
        f"CPU in all: {cpu * 1e6:.1f} us per request; at 1,000 requests/s {cpu * 1000 * 100:.1f}% of a core"
    )


if __name__ == "__main__":
    main()

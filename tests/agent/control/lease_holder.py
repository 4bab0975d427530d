"""A stand-in sidecar process for the kill -9 test: applies a degraded setting, then renews its lease.

Run as ``python lease_holder.py URL LEASE_S``; prints ``applied`` once the engine confirmed the setting.
"""

from __future__ import annotations

import asyncio
import sys

from agent.config import ControlConfig
from agent.control.client import ControlClient


async def main(url: str, lease_s: float) -> None:
    client = ControlClient(ControlConfig(enabled=True, url=url, adapter="generic", lease_s=lease_s))
    await client.start()
    result = await client.apply({"max_num_seqs": 8})
    print("applied" if result.ok else f"mismatch {result.mismatched}", flush=True)
    await asyncio.Event().wait()  # renew forever, until killed


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))

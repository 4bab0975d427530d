"""A stand-in agent for the SIGTERM test: lowers the simulated GPU's power limit, then waits.

Run as ``python gpu_holder.py STATE_FILE``; prints ``set`` once the limit is applied.
"""

from __future__ import annotations

import sys
import threading

from prometheus_client import CollectorRegistry

from agent.actuators.gpu import GpuActuator
from agent.actuators.gpu_backend import SimulatedGpuBackend
from agent.config import ActuatorConfig

if __name__ == "__main__":
    backend = SimulatedGpuBackend(count=2, state_file=sys.argv[1])
    cfg = ActuatorConfig(mode="act", gpu="power_limit", gpu_backend="simulated", gpu_lease_s=600)
    actuator = GpuActuator(cfg, backend, CollectorRegistry(), permission=lambda: None)
    actuator.install_signal_restore()
    actuator.set(250.0)
    print("set", flush=True)
    threading.Event().wait()

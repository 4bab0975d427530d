"""The checks that need a real NVIDIA GPU, as one short script: run it where one is lent.

CI has no GPU, so the project's tests drive NVML through monkeypatched pynvml, the probe through a fake
torch, and the GPU actuator through a simulated backend. This script runs the real paths once and prints
what it saw, so a session with a GPU can confirm (or refute) in about a minute what the tests assume:

1. NVML through :class:`agent.collectors.nvml_real.RealNvmlBackend`: every GPU's identity and one sample
   of each field (None: the GPU cannot report it), and this process's memory in its process list;
2. the allocator probe under CUDA: after a real allocation, the probe's ``/metrics`` (allocated and
   reserved bytes, fragmentation) and the UUID it serves for each device
   (``servepilot_probe_device_info``);
3. which NVML index each probed device is, matched by UUID as the sidecar does (agent/engine_gpus.py),
   and the GPU actuator's read-only calls (UUID, power-limit and clock bounds); nothing is set.

It needs only what the GPU image has (torch with CUDA, nvidia-ml-py, prometheus-client); not pydantic or
the rest of servepilot's dependencies. Exit status: 0 when every check held, 1 when one failed, 2 when
there is no CUDA GPU here. Usage: ``python3 scripts/gpu_check.py`` from the repository root.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ALLOCATE_BYTES = 256 << 20


def nvml_section(failures: list[str]) -> dict[int, str]:
    """Every GPU NVML sees and one sample of each; returns {index: UUID}."""
    from agent.collectors.nvml_real import RealNvmlBackend

    backend = RealNvmlBackend()
    infos = backend.init()
    print(f"nvml: {len(infos)} GPU(s), driver {infos[0].driver_version if infos else '?'}")
    backend.begin_round()
    for info in infos:
        sample = backend.sample(info.index, slow=True)
        fields = ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(sample).items())
        print(f"  GPU {info.index} {info.name} {info.uuid}: {fields}")
        processes = backend.processes(info.index)
        mine = processes.get(os.getpid())
        print(f"  GPU {info.index} processes: {dict(processes)} (this pid {os.getpid()}: {mine})")
    if not infos:
        failures.append("NVML lists no GPU")
    return {info.index: info.uuid for info in infos}


def probe_section(failures: list[str]) -> dict[int, str]:
    """The probe under CUDA after a real allocation; returns {device: UUID} as it serves them."""
    import torch
    from prometheus_client.parser import text_string_to_metric_families

    from agent.probe import server

    block = torch.empty(ALLOCATE_BYTES, dtype=torch.uint8, device="cuda")
    running = server.serve(0)
    try:
        with urllib.request.urlopen(running.url, timeout=10) as response:
            text = response.read().decode()
    finally:
        running.close()
    del block
    uuids: dict[int, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "servepilot_probe_device_info":
                uuids[int(sample.labels["device"])] = sample.labels["uuid"]
            elif sample.name in ("servepilot_probe_allocated_bytes", "servepilot_probe_reserved_bytes"):
                print(f"  probe {sample.name}{{device={sample.labels['device']}}} {sample.value:.0f}")
            elif sample.name in ("servepilot_probe_cuda_available", "servepilot_probe_fragmentation_ratio"):
                print(f"  probe {sample.name} {sample.labels or ''} {sample.value}")
    print(f"probe: device UUIDs {uuids}")
    allocated = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "servepilot_probe_allocated_bytes"
    ]
    if not allocated or max(allocated) < ALLOCATE_BYTES:
        failures.append(f"probe allocated_bytes {allocated} below the {ALLOCATE_BYTES} bytes allocated")
    if not uuids:
        failures.append("the probe served no device UUID")
    raw = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    print(f"  torch's own UUID text for the current device: {raw!r}")
    return uuids


def match_section(nvml: dict[int, str], probed: dict[int, str], failures: list[str]) -> None:
    """The probed devices as NVML indices, and the actuator's read-only view of them."""
    from agent.actuators.gpu_backend import GpuControlError, NvmlGpuBackend
    from agent.engine_gpus import indices_of

    indices, missing = indices_of(list(probed.values()), nvml)
    print(f"match: probed devices are NVML GPU(s) {indices}; not found: {missing}")
    if missing:
        failures.append(f"probe UUIDs {missing} not among NVML's {sorted(nvml.values())}")
    actuator = NvmlGpuBackend()
    for index in indices:
        try:
            print(
                f"  actuator GPU {index}: uuid {actuator.gpu_uuid(index)}, power limit "
                f"{actuator.power_limit_w(index)} W of {actuator.power_limit_bounds_w(index)} (default "
                f"{actuator.default_power_limit_w(index)}), clocks {actuator.clock_bounds_mhz(index)} MHz"
            )
        except GpuControlError as error:
            failures.append(f"actuator read on GPU {index}: {error}")


def main() -> int:
    try:
        import torch
    except ImportError:
        print("no torch here: nothing to check", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"no CUDA GPU here (torch {torch.__version__}): nothing to check", file=sys.stderr)
        return 2
    failures: list[str] = []
    nvml = nvml_section(failures)
    probed = probe_section(failures)
    match_section(nvml, probed, failures)
    for failure in failures:
        print(f"FAIL: {failure}")
    print("gpu_check: " + ("all checks held" if not failures else f"{len(failures)} check(s) failed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Actuators that change the node: the GPU actuator (NVML clocks or power limit)."""

"""Pure analysis: baselines, anomaly detectors, diagnosis and forecasters.

Nothing here does I/O or reads a clock: every function takes the time it reasons about as ``now``.
"""

"""``servepilot replay``: the simulator's engine core and servepilot's brain on a real trace, in virtual time.

:mod:`workload` reads and scales traces, :mod:`signals` builds the snapshot the live collectors would,
:mod:`driver` runs the closed loop, :mod:`brain` is the live loop's ``think`` plus the arbiter,
:mod:`runner` builds runs and sweeps, :mod:`summary` and :mod:`report` present them.
"""

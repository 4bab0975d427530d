"""Write a file so that readers see the old content or the new one, never half of either.

In the lowest layer so that everything that saves state shares it: the agent's state file and forecaster
state, and the LSTM forecaster's own ``save`` (detectors/ may not import agent/).
"""

from __future__ import annotations

import os
import tempfile


def write_atomically(path: str | os.PathLike[str], data: bytes, prefix: str = ".servepilot-") -> None:
    """Temp file in the same directory (so the rename stays on one file system), fsync, ``os.replace``;
    the temp file is removed when anything fails, including an interrupt."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, temp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise

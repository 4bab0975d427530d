"""Time-of-day schedules as data, with a required timezone (KEDA refuses a cron without one).

A schedule is a list of windows ``{days, start, end, mode}`` in one IANA timezone; :meth:`Schedule.mode_at`
says which mode (:data:`MODES`) holds at a Unix time. Windows may wrap midnight (``22:00-06:00``); the
first matching window wins; outside all windows, ``default``. A mode is one of :data:`MODES`, no free
label: the energy policy acts on ``peak`` alone, so a window written ``Peak`` or ``busy`` would have
done nothing, silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, time
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
#: ``peak`` holds the energy ladder at full clock; ``offpeak`` leaves it to the SLO-gated descent.
MODES = ("peak", "offpeak")


class ScheduleError(ValueError):
    """A schedule that cannot be used; one line naming the field."""


def _clock(text: str, field: str) -> time:
    try:
        hours, minutes = text.split(":")
        if hours == "24" and minutes == "00":
            return time(23, 59, 59, 999999)
        return time(int(hours), int(minutes))
    except (ValueError, AttributeError):
        raise ScheduleError(f"{field} must look like HH:MM, got {text!r}") from None


def _mode(value: Any, field: str) -> str:
    if value is None:
        raise ScheduleError(f"{field} is required ({' or '.join(MODES)})")
    if value not in MODES:
        raise ScheduleError(f"{field} must be {' or '.join(MODES)}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class Window:
    days: frozenset[int]
    start: time
    end: time
    mode: str

    def contains(self, local: datetime) -> bool:
        t, day = local.time(), local.weekday()
        if self.start <= self.end:
            return day in self.days and self.start <= t < self.end
        # wraps midnight: the part after midnight belongs to the previous day's window
        return (day in self.days and t >= self.start) or ((day - 1) % 7 in self.days and t < self.end)


@dataclass(frozen=True)
class Schedule:
    """Modes by local time of day and weekday in ``timezone``."""

    timezone: str
    windows: tuple[Window, ...]
    default: str = "offpeak"

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Schedule:
        """Build from a mapping (YAML): ``timezone`` is required, ``windows`` a list, ``default`` a mode."""
        tz = data.get("timezone")
        if not tz or not isinstance(tz, str):
            raise ScheduleError("schedule.timezone is required (an IANA name such as Europe/Paris)")
        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ScheduleError(f"schedule.timezone must be an IANA timezone, got {tz!r}") from None
        windows: list[Window] = []
        raw: Sequence[Mapping[str, Any]] = data.get("windows", ())
        for i, item in enumerate(raw):
            field = f"schedule.windows[{i}]"
            days = item.get("days", list(DAYS))
            bad = [d for d in days if d not in DAYS]
            if bad:
                raise ScheduleError(f"{field}.days must be among {', '.join(DAYS)}, got {bad[0]!r}")
            windows.append(
                Window(
                    frozenset(DAYS.index(d) for d in days),
                    _clock(item.get("start", ""), f"{field}.start"),
                    _clock(item.get("end", ""), f"{field}.end"),
                    _mode(item.get("mode"), f"{field}.mode"),
                )
            )
        return cls(tz, tuple(windows), _mode(data.get("default", "offpeak"), "schedule.default"))

    def mode_at(self, unix_s: float) -> str:
        """The mode in force at ``unix_s`` (no clock read: time is an argument)."""
        local = datetime.fromtimestamp(unix_s, ZoneInfo(self.timezone))
        for window in self.windows:
            if window.contains(local):
                return window.mode
        return self.default

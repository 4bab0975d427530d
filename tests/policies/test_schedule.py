from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from policies.schedule import Schedule, ScheduleError

DATA = {
    "timezone": "Europe/Paris",
    "windows": [
        {"days": ["mon", "tue", "wed", "thu", "fri"], "start": "09:00", "end": "18:00", "mode": "peak"},
        {"days": ["sat"], "start": "20:00", "end": "02:00", "mode": "peak"},
    ],
}


def _at(text: str, tz: str = "Europe/Paris") -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz)).timestamp()


def test_weekday_office_hours_are_peak():
    assert Schedule.from_data(DATA).mode_at(_at("2024-05-15 10:00")) == "peak"


def test_weekend_falls_back_to_default():
    assert Schedule.from_data(DATA).mode_at(_at("2024-05-18 10:00")) == "offpeak"


def test_window_wraps_midnight():
    schedule = Schedule.from_data(DATA)
    # Saturday's 20:00-02:00 window: its hours after midnight are Sunday's
    assert schedule.mode_at(_at("2024-05-18 23:00")) == "peak"
    assert schedule.mode_at(_at("2024-05-19 01:00")) == "peak"
    assert schedule.mode_at(_at("2024-05-19 03:00")) == "offpeak"
    assert schedule.mode_at(_at("2024-05-20 01:00")) == "offpeak"  # Sunday has no window


def test_mode_follows_the_schedule_timezone_not_utc():
    # 08:30 UTC is 10:30 in Paris (CEST): peak there.
    assert Schedule.from_data(DATA).mode_at(_at("2024-05-15 08:30", "UTC")) == "peak"


def test_timezone_is_required():
    with pytest.raises(ScheduleError, match="timezone is required"):
        Schedule.from_data({"windows": []})


def test_unknown_timezone_is_refused():
    with pytest.raises(ScheduleError, match="IANA"):
        Schedule.from_data({"timezone": "Mars/Olympus"})


def test_bad_clock_names_the_field():
    with pytest.raises(ScheduleError, match=r"windows\[0\].start"):
        Schedule.from_data({"timezone": "UTC", "windows": [{"start": "9am", "end": "10:00", "mode": "peak"}]})


@pytest.mark.parametrize(
    ("window", "needle"),
    [
        (
            {"start": "09:00", "end": "10:00", "mode": "Peak"},
            r"windows\[0\]\.mode must be peak or offpeak, got 'Peak'",
        ),
        ({"start": "09:00", "end": "10:00"}, r"windows\[0\]\.mode is required"),
    ],
)
def test_a_mode_the_policies_do_not_know_is_refused(window: dict[str, str], needle: str) -> None:
    """Only ``peak`` does anything: a window written ``Peak`` would have been a no-op, found at peak."""
    with pytest.raises(ScheduleError, match=needle):
        Schedule.from_data({"timezone": "UTC", "windows": [window]})
    with pytest.raises(ScheduleError, match=r"schedule\.default must be peak or offpeak"):
        Schedule.from_data({"timezone": "UTC", "default": "night"})

"""Fuzz the config loader: any mapping, any environment, any file gives a Config or one ConfigError line.

A typo in a pod's ConfigMap must stop start-up with a line that names the field, never a traceback from
deep inside pydantic or PyYAML (which an operator cannot act on) and never a half-built config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from agent.config import Config, ConfigError, build, load
from tests.fuzz.strategies import FUZZ

SECTIONS = sorted(Config.model_fields)
FIELDS = sorted({f for s in Config.model_fields.values() for f in s.annotation.model_fields})  # type: ignore[union-attr]

_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["http://127.0.0.1:1", "act", "nvml", "1e9", "-1", "0"]),
)
_VALUE = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner)
    ),
    max_leaves=12,
)
# mostly real section and field names, so validation goes past "is not a known setting"
_SECTION = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), _VALUE, max_size=5)
_CONFIG = st.dictionaries(st.sampled_from(SECTIONS) | st.text(max_size=8), _SECTION | _VALUE, max_size=4)


def _check(outcome: Config | ConfigError) -> None:
    if isinstance(outcome, ConfigError):
        message = str(outcome)
        assert message and "\n" not in message and len(message) < 2000
    else:
        assert isinstance(outcome, Config)


def _build(data: Any, environ: dict[str, str] | None = None) -> Config | ConfigError:
    try:
        return build(data, environ)
    except ConfigError as error:
        return error


@FUZZ
@given(data=st.one_of(_CONFIG, _VALUE))
def test_build_gives_a_config_or_one_line(data: Any) -> None:
    _check(_build(data))


@FUZZ
@given(
    section=st.sampled_from(SECTIONS),
    field=st.sampled_from(FIELDS),
    raw=st.text(max_size=40),
    extra=st.dictionaries(st.text(max_size=12).map(lambda k: "SERVEPILOT_" + k), st.text(max_size=10)),
)
def test_environment_overrides_give_a_config_or_one_line(
    section: str, field: str, raw: str, extra: dict[str, str]
) -> None:
    environ = {f"SERVEPILOT_{section.upper()}__{field.upper()}": raw, **extra}
    _check(_build({}, environ))


@FUZZ
@given(content=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_load_of_any_file_gives_a_config_or_one_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    try:
        outcome: Config | ConfigError = load(path)
    except ConfigError as error:
        outcome = error
    _check(outcome)


# Regressions the fuzzer found; each is one line of the contract above.
def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"agent:\n  interval_s: \x80\n")
    try:
        load(path)
    except ConfigError as error:
        assert "config.yaml" in str(error)
    else:
        raise AssertionError("a non-UTF-8 file loaded")


def test_a_key_with_a_newline_is_reported_on_one_line() -> None:
    outcome = _build({"agent\nFAKE LOG LINE": {}})
    assert isinstance(outcome, ConfigError) and "\n" not in str(outcome)


def test_an_environment_name_with_a_newline_is_reported_on_one_line() -> None:
    outcome = _build({}, {"SERVEPILOT_\nFAKE": "1"})
    assert isinstance(outcome, ConfigError) and "\n" not in str(outcome)

"""Building the config from YAML and the environment, and its errors: one line that names the field."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import ValidationError

from agent.config.root import Config

ENV_PREFIX = "SERVEPILOT_"


class ConfigError(ValueError):
    """A configuration problem, as one line that names the field."""

    def __init__(self, field: str, message: str) -> None:
        text = f"{field} {message}" if field else message
        # one line, always: a newline smuggled in through a key or a value cannot forge a log line
        super().__init__(text.replace("\r", "\\r").replace("\n", "\\n"))
        self.field = field


def format_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return str(int(value))
    return repr(value) if isinstance(value, str) else str(value)


def _walk(loc: tuple[str | int, ...]) -> tuple[Any, Any]:
    """The type at ``loc`` in :class:`Config` and the field declaring it (None for the root, a mapping's
    entry, or a path that names no field: then the type is None too)."""
    model: Any = Config
    info = None
    for part in loc:
        if get_origin(model) is dict:  # a mapping of sections (gate.lines.<name>): the key names no field
            model, info = get_args(model)[1], None
            continue
        if not isinstance(part, str) or not hasattr(model, "model_fields") or part not in model.model_fields:
            return None, None
        info = model.model_fields[part]
        model = info.annotation
    return model, info


def _shared_start(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _unknown(loc: tuple[str | int, ...]) -> ConfigError:
    """An unknown setting, with the known one its name is closest to: ``state_file`` for
    ``state_path`` is a typo the operator should not have to look up in the reference."""
    field = ".".join(str(p) for p in loc)
    model, _ = _walk(loc[:-1])
    name = str(loc[-1]) if loc else ""
    close = difflib.get_close_matches(name, list(getattr(model, "model_fields", ())), n=5, cutoff=0.6)
    # a setting's name says what first (state_, max_): of the close ones, the one starting as the typo
    # does (state_path, not tls_key_file, for state_file)
    close.sort(key=lambda known: _shared_start(name, known), reverse=True)
    hint = f" (did you mean {'.'.join([*(str(p) for p in loc[:-1]), close[0]])}?)" if close else ""
    return ConfigError(field, f"is not a known setting{hint}")


def _bounds(loc: tuple[str | int, ...]) -> tuple[str, str] | None:
    """The [lower, upper] bounds declared on the field at ``loc``, for a complete range message."""
    _, info = _walk(loc)
    if info is None:
        return None
    lo, hi, lo_open, hi_open = "-inf", "inf", False, False
    for meta in info.metadata:
        if isinstance(meta, Ge):
            lo = format_value(meta.ge)
        elif isinstance(meta, Gt):
            lo, lo_open = format_value(meta.gt), True
        elif isinstance(meta, Le):
            hi = format_value(meta.le)
        elif isinstance(meta, Lt):
            hi, hi_open = format_value(meta.lt), True
    if (lo, hi) == ("-inf", "inf"):
        return None
    return ("(" if lo_open else "[") + lo, hi + (")" if hi_open else "]")


def _describe(error: ValidationError) -> ConfigError:
    first = error.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    kind, value = first["type"], first.get("input")
    if len(loc) >= 2 and loc[-1] == "[key]" and kind == "literal_error":  # a mapping's key: name the mapping
        expected = first.get("ctx", {}).get("expected", "")
        mapping = ".".join(str(p) for p in loc[:-2])
        return ConfigError(mapping, f"keys must be {expected}, got {format_value(value)}")
    field = ".".join(str(p) for p in loc)
    if kind == "extra_forbidden":
        return _unknown(loc)
    if kind == "missing":
        return ConfigError(field, "is required")
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}:
        bounds = _bounds(loc)
        if bounds:
            return ConfigError(field, f"must be in {bounds[0]}, {bounds[1]}, got {format_value(value)}")
    if kind == "literal_error":
        expected = first.get("ctx", {}).get("expected", "")
        # YAML 1.1 turns an unquoted on/off/yes/no into a boolean, which no choice field holds
        hint = (
            " (YAML reads an unquoted on/off/yes/no as a boolean: quote the word)"
            if isinstance(value, bool)
            else ""
        )
        return ConfigError(field, f"must be one of {expected}, got {format_value(value)}{hint}")
    message = first["msg"].removeprefix("Value error, ")
    last = str(loc[-1]) if loc else ""
    if last and message.startswith(last + "."):  # a rule that names a part of its field (schedule.timezone)
        name, _, rest = message.partition(" ")
        return ConfigError(".".join([*(str(p) for p in loc[:-1]), name]), rest)
    if len(loc) <= 1 and isinstance(value, Mapping):  # a section-level rule names its field first
        name, _, rest = message.partition(" ")
        return ConfigError(f"{field}.{name}" if field else name, rest)
    return ConfigError(field, f"{message[0].lower()}{message[1:]}, got {format_value(value)}")


def _parse_env_value(raw: str) -> Any:
    """Environment values are YAML scalars, so ``2``, ``true`` and ``[0, 1]`` get their types."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _env_path(key: str) -> list[str]:
    """``SERVEPILOT_AGENT__INTERVAL_S`` -> ``["agent", "interval_s"]`` (checked by the caller)."""
    return key[len(ENV_PREFIX) :].lower().split("__")


def apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Return ``data`` with ``SERVEPILOT_SECTION__FIELD`` overrides from ``environ`` applied."""
    merged: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for key, raw in sorted(environ.items()):
        if not key.startswith(ENV_PREFIX):
            continue
        path = _env_path(key)
        if len(path) != 2 or not all(path):
            raise ConfigError(key, "must look like SERVEPILOT_<SECTION>__<FIELD>")
        section = merged.setdefault(path[0], {})
        if not isinstance(section, dict):
            raise ConfigError(path[0], "must be a mapping")
        section[path[1]] = _parse_env_value(raw)
    return merged


def build(data: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> Config:
    """Validate a parsed mapping (plus environment overrides) into a :class:`Config`."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("", f"config must be a YAML mapping at the top level, got {type(data).__name__}")
    merged = apply_env(dict(data), environ or {})
    try:
        return Config.model_validate(merged)
    except ValidationError as error:
        raise _naming_the_variable(_describe(error), data, environ or {}) from None


def _naming_the_variable(
    error: ConfigError, data: Mapping[str, Any], environ: Mapping[str, str]
) -> ConfigError:
    """``error``, naming the environment variable that set its field where one did: a typo in a pod's
    ``env:`` is not in the config file the operator would search for it."""
    for key in sorted(environ):
        path = _env_path(key) if key.startswith(ENV_PREFIX) else []
        if len(path) != 2:
            continue
        dotted = ".".join(path)
        if (
            error.field == dotted
            or error.field.startswith(dotted + ".")
            or (
                error.field == path[0] and path[0] not in data  # a section only the variable names
            )
        ):
            text = str(error)
            return ConfigError(f"{error.field} (from {key})", text[len(error.field) + 1 :])
    return error


def load(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (YAML) and build the config; every problem is a one-line :class:`ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError("", f"config {str(path)!r} is not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ConfigError("", f"cannot read config {str(path)!r}: {error.strerror or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        # the parser's own words ("found character '\\t' that cannot start any token") name a character
        # or a token, never a value, so a key in the file cannot reach the log through them
        problem = getattr(error, "problem", None)
        why = f": {problem}" if problem else ""
        raise ConfigError("", f"config {str(path)!r} is not valid YAML{where}{why}") from None
    return build(data, environ)

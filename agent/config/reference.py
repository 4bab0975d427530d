"""The config reference the README embeds, generated from the model."""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel

from agent.config.loading import format_value
from agent.config.root import Config


def reference_markdown() -> str:
    """The config reference as a Markdown table, generated from the model (the README embeds it). A map
    of named sub-sections (``gate.lines``) is followed by its entries' fields, as ``gate.lines.<name>.x``."""
    rows = ["| setting | default | allowed | meaning |", "|---|---|---|---|"]
    for section_name, section in Config.model_fields.items():
        model = section.annotation
        assert model is not None
        for name, info in model.model_fields.items():
            rows.append(_reference_row(f"{section_name}.{name}", info))
            args = typing.get_args(info.annotation)
            entry = args[1] if typing.get_origin(info.annotation) is dict and len(args) == 2 else None
            if isinstance(entry, type) and issubclass(entry, BaseModel):
                for sub, sub_info in entry.model_fields.items():
                    rows.append(_reference_row(f"{section_name}.{name}.<name>.{sub}", sub_info))
    return "\n".join(rows)


def _reference_row(setting: str, info: Any) -> str:
    required = info.is_required()
    default = None if required else info.get_default(call_default_factory=True)  # {}, not undefined
    default = list(default) if isinstance(default, tuple) else default
    allowed = []
    for meta in info.metadata:
        for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if hasattr(meta, attr):
                allowed.append(f"{symbol} {format_value(getattr(meta, attr))}")
    annotation = info.annotation
    if typing.get_origin(annotation) is dict:  # a map: what its keys may be, where they are fixed
        key = typing.get_args(annotation)[0]
        if typing.get_origin(key) is typing.Literal:
            allowed.append("keys " + " \\| ".join(str(c) for c in typing.get_args(key)))
    elif "Literal" in str(annotation):
        allowed.append(" \\| ".join(str(c) for c in getattr(annotation, "__args__", ())))
    if required:
        default_text = "required"
    elif isinstance(default, bool):
        default_text = str(default).lower()
    elif isinstance(default, dict):
        default_text = json.dumps(default)  # as YAML reads it
    elif default is None:
        default_text = "null"  # as YAML writes it
    else:
        default_text = str(default)
    meaning = info.description or ""
    return f"| `{setting}` | `{default_text}` | {', '.join(allowed)} | {meaning} |"

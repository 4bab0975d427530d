"""The README's config reference is generated from the config model; this keeps the two in step."""

from __future__ import annotations

import re
from pathlib import Path

from agent.config import reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_is_current() -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- config-reference:start[^>]*-->\n(.*?)<!-- config-reference:end -->", text, re.S)
    assert match, "README lost its config-reference markers"
    assert match.group(1).strip() == reference_markdown().strip(), (
        "README config reference is stale: paste `servepilot validate-config --reference` between the markers"
    )


def test_readme_names_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text

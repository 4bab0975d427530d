"""The command line: every subcommand has --help, bad usage exits 2, and startup stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent.cli import COMMANDS, build_parser, main


def _subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)  # type: ignore[arg-type]


def test_every_registered_module_adds_a_subcommand() -> None:
    assert len(_subcommands()) == len(COMMANDS)
    assert {"run", "demo", "sim", "validate-config"} <= set(_subcommands())


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: servepilot " + command in capsys.readouterr().out


def test_no_subcommand_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_help_does_not_import_heavy_libraries() -> None:
    """`servepilot --help` must be instant: torch, numpy-heavy stacks and aiohttp load only when used."""
    code = (
        "import sys; from agent.cli import build_parser; build_parser().format_help(); "
        "heavy = [m for m in ('torch', 'statsmodels', 'sklearn', 'aiohttp') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""

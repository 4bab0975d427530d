"""The speculative-decoding flags of ``servepilot sim`` and ``servepilot replay``: one definition, so the
simulated engine drafts alike whether it serves HTTP or replays a trace in virtual time."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simulator.specdec import SpecDecodeConfig


def add_spec_flags(parser: argparse.ArgumentParser, title: str) -> None:
    """``--spec-tokens``, ``--spec-acceptance`` and ``--spec-draft-cost`` in a group named ``title``."""
    spec = parser.add_argument_group(title)
    spec.add_argument(
        "--spec-tokens", type=int, default=0, help="draft tokens per decode step (default 0: no drafting)"
    )
    spec.add_argument(
        "--spec-acceptance",
        type=float,
        default=0.7,
        help="per-token acceptance of the drafts (default 0.7; at run time: fault spec_acceptance)",
    )
    spec.add_argument(
        "--spec-draft-cost",
        type=float,
        default=0.0,
        help="a draft token's cost as a share of the step (default 0: n-gram lookup; a draft model ~0.05)",
    )


def spec_config(args: argparse.Namespace) -> SpecDecodeConfig:
    """The flags as a :class:`~simulator.specdec.SpecDecodeConfig` (seeded by ``--seed``); a flag out of
    range is a ValueError naming it."""
    from simulator.specdec import SpecDecodeConfig

    for flag, value, high in (
        ("--spec-tokens", args.spec_tokens, 16),
        ("--spec-acceptance", args.spec_acceptance, 1),
        ("--spec-draft-cost", args.spec_draft_cost, 1),
    ):
        if not 0 <= value <= high:
            raise ValueError(f"{flag} must be in [0, {high}], got {value:g}")
    return SpecDecodeConfig(args.spec_tokens, args.spec_acceptance, args.spec_draft_cost, args.seed)

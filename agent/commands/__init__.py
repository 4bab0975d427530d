"""One module per ``servepilot`` subcommand. Each exposes ``register(subparsers)``; the parser it adds
sets ``func`` to a callable ``(args) -> int`` returning the exit code."""

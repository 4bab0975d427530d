# syntax=docker/dockerfile:1
# servepilot sidecar image: CPU-only Python (torch on the CPU serves the LSTM forecaster), no CUDA toolkit.
# NVML (libnvidia-ml.so.1) is not in the image: the NVIDIA container runtime mounts the driver's copy when
# the container sees a GPU (NVIDIA_DRIVER_CAPABILITIES=utility is all NVML reads need). See docs/deploy.md.
#
#   docker build -t servepilot:0.1.0 .
#   docker run --rm --gpus all servepilot:0.1.0            # expects /etc/servepilot/config.yaml
#
# Where torch comes from: PyPI's torch 2.13.0 for Linux x86_64 is the CUDA build (several GB). The builder
# takes the CPU wheel from PyTorch's CPU index (TORCH_INDEX_URL below). A build that must not reach it
# (an offline mirror, or a machine whose pip.conf already points at a local CPU wheel through find-links)
# passes --build-arg TORCH_INDEX_URL= and pip uses its configured sources instead. tests/deploy runs the
# builder's install steps, exactly as written here, in a fresh virtual environment that way.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- builder: a virtual environment with servepilot and its ML extras ------------------------------------
FROM ${PYTHON_IMAGE} AS builder

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV VIRTUAL_ENV=/opt/servepilot \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src

# torch first and alone (its own layer, cached across source changes), so the CPU wheel is what satisfies
# the pin in pyproject's "ml" extra when the project is installed next
RUN python -m venv "$VIRTUAL_ENV" \
    && "$VIRTUAL_ENV/bin/pip" install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
        "torch==2.13.0"

COPY pyproject.toml README.md ./
COPY agent ./agent
COPY detectors ./detectors
COPY policies ./policies
COPY simulator ./simulator
RUN "$VIRTUAL_ENV/bin/pip" install --no-cache-dir ".[ml]" \
    && "$VIRTUAL_ENV/bin/servepilot" --help > /dev/null

# ---- runtime: the environment alone, as an unprivileged user ---------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="servepilot" \
      org.opencontainers.image.description="Autotuning sidecar for GPU LLM inference engines (vLLM, SGLang, llama.cpp)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim" \
      org.opencontainers.image.documentation="docs/deploy.md"

# uid/gid 10001: outside the range of host and distribution accounts, so a mounted file is never owned
# by someone real by accident. Kubernetes' runAsNonRoot needs a numeric USER to verify.
RUN groupadd --system --gid 10001 servepilot \
    && useradd --system --uid 10001 --gid servepilot --home-dir /var/lib/servepilot --create-home \
        --shell /usr/sbin/nologin servepilot \
    && mkdir -p /etc/servepilot \
    && chown servepilot:servepilot /etc/servepilot

COPY --from=builder /opt/servepilot /opt/servepilot

ENV VIRTUAL_ENV=/opt/servepilot \
    PATH=/opt/servepilot/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_DRIVER_CAPABILITIES=utility

# The audit log, webhook outbox and forecaster state live here (relative paths in the config resolve
# against the working directory); mount a volume to keep them across restarts.
WORKDIR /var/lib/servepilot
USER 10001:10001

# 9400: agent API and /metrics; 8080: the admission gate (the pod's service port)
EXPOSE 9400 8080

# Liveness only: /healthz answers while the process serves. Readiness (/readyz) is the orchestrator's.
HEALTHCHECK --interval=30s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9400/healthz', timeout=2).status != 200)"]

# Reading NVML needs no privilege. Writing GPU clocks or power limits (actuators.gpu != off) needs root or
# CAP_SYS_ADMIN: grant that capability in the orchestrator only where that knob is used (docs/deploy.md).
ENTRYPOINT ["servepilot"]
CMD ["run", "--config", "/etc/servepilot/config.yaml"]

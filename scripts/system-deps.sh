#!/usr/bin/env bash
# System packages the end-to-end tests use: real Prometheus + promtool, Alertmanager, nginx (gate bench
# reference). Installed from Debian's packages when missing and we are root; otherwise says what to run.
set -euo pipefail
packages=(prometheus prometheus-alertmanager nginx)
missing=()
for pkg in "${packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: missing ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}" >&2
  echo "system-deps: the end-to-end tests that need them are skipped locally (and fail under CI=true)" >&2
  exit 0
fi
echo "system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian's packages start their services where an init system runs; the tests start their own copies.
for svc in prometheus prometheus-alertmanager nginx; do
  if command -v service >/dev/null 2>&1; then service "$svc" stop >/dev/null 2>&1 || true; fi
done

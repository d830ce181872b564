#!/usr/bin/env bash
# Installs the package with megatron-core into ./.venv (skipped when nothing changed, see
# scripts/install.sh) and runs the distributed smoke job (4 CPU ranks over gloo by default).
# Extra arguments go to `media-guard smoke`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh megatron
echo "[smoke.sh] running: media-guard smoke $*" >&2
exec .venv/bin/media-guard smoke "$@"

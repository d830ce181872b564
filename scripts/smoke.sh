#!/usr/bin/env bash
# Installs the package with megatron-core into ./.venv and runs the distributed smoke job
# (4 CPU ranks over gloo by default). Extra arguments go to `media-guard smoke`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[megatron]"
exec .venv/bin/media-guard smoke "$@"

#!/usr/bin/env bash
# Installs the package into ./.venv with the given extra ("megatron" or "test"), unless the
# same install is already there: the stamp .venv/.media_guard_install.<extra> holds a hash of
# pyproject.toml, the extra and the Python version; the package itself is editable, so code
# changes need no reinstall. MEDIA_GUARD_REINSTALL=1 forces the install. A clean clone (no
# .venv, no stamp) always installs. Progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="${1:?usage: scripts/install.sh megatron|test}"
PY="${PYTHON:-python3}"
say() { echo "[install] $*" >&2; }
if [ ! -x .venv/bin/python ]; then
    say "creating ./.venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
fi
STAMP=".venv/.media_guard_install.$EXTRA"
# sha256 through Python's hashlib: sha256sum is GNU coreutils (absent on macOS)
sha256() { .venv/bin/python -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'; }
WANT="$( (cat pyproject.toml scripts/install.sh; echo "extra=$EXTRA"; .venv/bin/python --version) | sha256)"
if [ "${MEDIA_GUARD_REINSTALL:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
    && .venv/bin/python -c "import torch, megatron_media_guard" 2>/dev/null; then
    say "./.venv is up to date for [$EXTRA] (pyproject.toml unchanged): skipping pip"
    exit 0
fi
say "installing torch==2.13.0 and the package with [$EXTRA] into ./.venv (first run: a few minutes)"
rm -f "$STAMP"
if ! .venv/bin/python -m pip install --disable-pip-version-check --progress-bar on \
    "torch==2.13.0" -e ".[$EXTRA]" 2>&1 \
    | { grep -v -E "^\s*(Requirement already satisfied|Using cached)" || true; } >&2; then
    say "pip install failed"
    exit 1
fi
echo "$WANT" > "$STAMP"
say "done"

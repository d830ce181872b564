#!/usr/bin/env bash
# The adapter tests on megatron-core 0.19.2 (the release Megatron-Bridge 0.6 runs Nemotron VL /
# Omni on), besides the 0.16.x the venv holds. 0.19.2's wheel is tagged for Python 3.12, its
# sources run on 3.11: the wheel from the package index is unpacked into .mcore019/ (ignored by
# git; kept between runs) and put first on PYTHONPATH, which spawned test processes inherit.
# It imports triton unconditionally: installed into the venv when missing.
# Megatron-Bridge 0.6.2's model code (its wheel, pure Python) is unpacked the same way into
# .bridge062/; the tests import its leaf modules through megatron_media_guard.testing.bridge
# (path-only packages: its package __init__s need Transformer Engine). Its config code imports
# omegaconf (pure Python): installed into the venv when missing.
# Platforms: required on Linux x86_64 (CI: any failure fails the run). Elsewhere the step is
# skipped with a message (exit 0) where it cannot run: at once on macOS / Windows (the wheels
# of megatron-core 0.19.2 and of triton are Linux-only), and on another Linux machine when this
# platform has no wheel of either (pip finds none).
# Usage: scripts/test_mcore019.sh [pytest args; default: the adapter test files]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.19.2
TRITON=3.9.0
DEST=.mcore019
BRIDGE=0.6.2
BRIDGE_DEST=.bridge062
OMEGACONF=2.4.0
PY=.venv/bin/python
PLATFORM="$(uname -s) $(uname -m)"
skip() {
    echo "[mcore019] SKIPPED: $1; the megatron-core $VERSION adapter tests are required on" \
        "Linux x86_64 only (CI), and run there" >&2
    exit 0
}
case "$PLATFORM" in
    "Linux x86_64") REQUIRED=1 ;;
    Linux\ *) REQUIRED=0 ;;
    *) skip "no megatron-core $VERSION / triton wheel for $PLATFORM (Linux only)" ;;
esac
[ -x "$PY" ] || { echo "no $PY: run scripts/test.sh first" >&2; exit 2; }

if [ "$(cat "$DEST/.version" 2>/dev/null)" != "$VERSION" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    # the wheels are tagged cp312 (pip picks this platform's); the sources run on 3.11 too
    if ! "$PY" -m pip download -q --disable-pip-version-check --no-deps --python-version 3.12 \
        --only-binary=:all: -d "$tmp" "megatron-core==$VERSION"; then
        [ "$REQUIRED" = 1 ] && { echo "[mcore019] pip download failed" >&2; exit 1; }
        skip "pip could not fetch a megatron-core $VERSION wheel for $PLATFORM (none for it, or no index)"
    fi
    rm -rf "$DEST"
    "$PY" -m zipfile -e "$tmp"/megatron_core-"$VERSION"-*.whl "$DEST"
    echo "$VERSION" > "$DEST/.version"
    rm -rf "$tmp"; trap - EXIT  # the script ends in exec, which skips EXIT traps
fi
if ! "$PY" -c "import triton" 2>/dev/null &&
    ! "$PY" -m pip install -q --disable-pip-version-check "triton==$TRITON"; then
    [ "$REQUIRED" = 1 ] && { echo "[mcore019] pip install triton==$TRITON failed" >&2; exit 1; }
    skip "pip could not install triton $TRITON on $PLATFORM (no wheel for it, or no index)"
fi

if [ "$(cat "$BRIDGE_DEST/.version" 2>/dev/null)" != "$BRIDGE" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    if ! "$PY" -m pip download -q --disable-pip-version-check --no-deps --python-version 3.12 \
        --only-binary=:all: -d "$tmp" "megatron-bridge==$BRIDGE"; then
        [ "$REQUIRED" = 1 ] && { echo "[mcore019] pip download megatron-bridge failed" >&2; exit 1; }
        skip "pip could not fetch a megatron-bridge $BRIDGE wheel (no index)"
    fi
    rm -rf "$BRIDGE_DEST"
    "$PY" -m zipfile -e "$tmp"/megatron_bridge-"$BRIDGE"-*.whl "$BRIDGE_DEST"
    echo "$BRIDGE" > "$BRIDGE_DEST/.version"
    rm -rf "$tmp"; trap - EXIT
fi
if ! "$PY" -c "import omegaconf" 2>/dev/null &&
    ! "$PY" -m pip install -q --disable-pip-version-check "omegaconf==$OMEGACONF"; then
    [ "$REQUIRED" = 1 ] && { echo "[mcore019] pip install omegaconf==$OMEGACONF failed" >&2; exit 1; }
    skip "pip could not install omegaconf $OMEGACONF (no index)"
fi

export PYTHONPATH="$PWD/$DEST${PYTHONPATH:+:$PYTHONPATH}"
export MEGATRON_BRIDGE_ROOT="$PWD/$BRIDGE_DEST"
"$PY" - "$VERSION" <<'PYEOF'
import sys
import warnings

warnings.simplefilter("ignore")
from importlib.metadata import version

import megatron.core as mc

# the wheel's own version: megatron.core.__version__ appends `git rev-parse HEAD` of the
# working directory, which is this repository's commit, not megatron-core's
v = version("megatron-core")
assert v == sys.argv[1], f"megatron-core {v} on the path, not {sys.argv[1]}"
assert mc.__version__.split("+")[0] == v, f"megatron.core {mc.__version__} is not the wheel {v}"
print(f"megatron-core {v} from {mc.__file__}")
PYEOF
# Bridge's leaf model modules import (a broken fetch fails here, not as skipped tests)
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$BRIDGE" <<'PYEOF'
import importlib
import os
import sys
import warnings

warnings.simplefilter("ignore")
from megatron_media_guard.testing import bridge
from megatron_media_guard.testing.bridge_models import (
    ERNIE45VL, GLM45V, NEMOTRON_OMNI, NEMOTRON_VL, QWEN3, QWEN25,
)
from megatron_media_guard.testing.bridge_models_kimi import KIMI_K25_VL
from megatron_media_guard.testing.bridge_models_omni import THINKER

assert bridge.missing() is None, bridge.missing()
root = os.environ["MEGATRON_BRIDGE_ROOT"]
with bridge.bridge_modules(root):
    for name in (QWEN25, QWEN3, NEMOTRON_VL, NEMOTRON_OMNI, GLM45V, ERNIE45VL, KIMI_K25_VL, THINKER):
        importlib.import_module(name)
print(f"megatron-bridge {sys.argv[1]} model modules from {root}")
PYEOF
if [ "$#" -eq 0 ]; then
    set -- tests/test_adapter_llava.py tests/test_adapter_llava_mcore019.py \
        tests/test_adapter_llava_omni.py tests/test_adapter_mimo.py tests/test_launcher.py \
        tests/test_adapter_dist.py tests/test_dist_layouts.py \
        tests/test_adapter_qwen_vl_bridge.py tests/test_adapter_llava_bridge.py \
        tests/test_family_bridge.py \
        tests/test_family_qwen3_omni_bridge.py
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"

#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA GPU, under 5 minutes:
#   1. the suite's CUDA-marked tests (and the merge/repair tests on CUDA tensors),
#   2. CUDA re-projection timing and the aligned merge ratio on the GPU,
#   3. a world-size-1 NCCL smoke (needs megatron-core; skipped with a note otherwise),
#   4. transformer-engine FP8 detection when TE is installed.
# Uses the project's environment, ./.venv/bin/python (scripts/install.sh test makes it; its
# torch must be a CUDA build), or $PYTHON when set; installs nothing from the network: the
# package is put on PYTHONPATH. Prints one summary line per step.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PY" ] && ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check: no Python at $PY: run 'bash scripts/install.sh test' first (it makes ./.venv), or set PYTHON=/path/to/python" >&2
  exit 2
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu_check: $PY has no torch: run 'bash scripts/install.sh test', or set PYTHON to an environment with a CUDA torch" >&2
  exit 2
fi
echo "gpu_check: using $PY"
status=0
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 2
step "cuda tests" 150 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
step "cuda timing" 90 "$PY" scripts/gpu_timing.py
if "$PY" -c "import megatron.core" 2>/dev/null; then
  step "nccl smoke (world size 1)" 90 "$PY" -m megatron_media_guard smoke --backend nccl --nproc 1 --steps 2 --scenario budget_shrink --policy drop
else
  echo "== nccl smoke: skipped (megatron-core not installed here)"
fi
if "$PY" -c "import transformer_engine.pytorch" 2>/dev/null; then
  step "transformer-engine fp8" 60 "$PY" -c "
import torch, transformer_engine.pytorch as te
from megatron_media_guard.repair.fp8 import fp8_active, fp8_multiple
print('fp8 outside autocast:', fp8_active(None))
with te.fp8_autocast(enabled=True):
    print('fp8 inside autocast:', fp8_active(None), 'align', fp8_multiple(None))
"
else
  echo "== transformer-engine: not installed, skipped"
fi
exit $status

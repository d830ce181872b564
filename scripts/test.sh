#!/usr/bin/env bash
# Installs the package with its test extra into ./.venv (skipped when nothing changed, see
# scripts/install.sh) and runs lint + the test suite.
# Needs only Python >= 3.10 and pip. Extra arguments go to pytest (and skip the 0.19 step).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test  # skipped when pyproject.toml is unchanged (a clean clone installs)
.venv/bin/ruff check megatron_media_guard tests benchmarks scripts
.venv/bin/ruff format --check megatron_media_guard tests benchmarks scripts
.venv/bin/python -m pytest -q "$@"
# A full run (no arguments) also runs the adapter tests on megatron-core 0.19.2, the release
# Megatron-Bridge 0.6 uses (unpacked from its wheel into .mcore019/, see the script).
if [ "$#" -eq 0 ]; then
    bash scripts/test_mcore019.sh
fi

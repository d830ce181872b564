#!/usr/bin/env bash
# Installs the package with its test extra into ./.venv (skipped when nothing changed, see
# scripts/install.sh) and runs lint + the test suite.
# Needs only Python >= 3.10 and pip. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test  # skipped when pyproject.toml is unchanged (a clean clone installs)
.venv/bin/ruff check megatron_media_guard tests benchmarks scripts
.venv/bin/ruff format --check megatron_media_guard tests benchmarks scripts
exec .venv/bin/python -m pytest -q "$@"

#!/usr/bin/env bash
# Installs the package with megatron-core into ./.venv (skipped when nothing changed, see
# scripts/install.sh) and runs the distributed smoke job (4 CPU ranks over gloo by default).
# Extra arguments go to `media-guard smoke`. Unlike `media-guard smoke` alone (a temporary log
# directory, removed after a passing run), the logs, the post-mortem page (report.html) and the
# replay bundles are kept: --log-dir defaults to media_guard_logs/smoke-<UTC time>/ and
# --dump-dir to <log dir>/bundles/ (each can be given; --dump-dir '' saves no bundle).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh megatron
log_dir="" has_log=0 has_dump=0 prev=""
for arg in "$@"; do
    case "$arg" in
        --log-dir=*) has_log=1 log_dir="${arg#--log-dir=}" ;;
        --dump-dir | --dump-dir=*) has_dump=1 ;;
    esac
    [ "$prev" = "--log-dir" ] && { has_log=1; log_dir="$arg"; }
    prev="$arg"
done
extra=()
if [ "$has_log" = 0 ]; then
    log_dir="media_guard_logs/smoke-$(date -u +%Y%m%dT%H%M%SZ)"
    extra+=(--log-dir "$log_dir")
fi
[ "$has_dump" = 0 ] && extra+=(--dump-dir "$log_dir/bundles")
echo "[smoke.sh] running: media-guard smoke ${extra[*]+${extra[*]}} $*" >&2
exec .venv/bin/media-guard smoke ${extra[@]+"${extra[@]}"} "$@"

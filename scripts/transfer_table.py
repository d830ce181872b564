"""Device-to-host transfers per aligned call of the family engine, per family x modality mix.

    .venv/bin/python scripts/transfer_table.py

Each row is one aligned batch of the family's fixture (``megatron_media_guard/testing/families``)
run through ``install_vlm`` on the family's tiny transformers class, as
``tests/families/test_contract.py`` runs it; the count is ``core.host.count_transfers``'s, with
the reasons. Issue 24's target: 1 everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "families"), str(ROOT / "tests"), str(ROOT)]

from test_contract import TRANSFER_ROWS, aligned_transfers  # noqa: E402


def main() -> None:
    print("| family | mix | transfers | reasons |")
    print("|---|---|---|---|")
    for name, mix, samples in TRANSFER_ROWS:
        try:
            n, reasons = aligned_transfers(name, samples, own=False)  # transfers, not accuracy
        except Exception as e:  # a row the fixture or the guard refuses: shown, not hidden
            print(f"| {name} | {mix} | error | {type(e).__name__}: {e} |", flush=True)
            continue
        why = "; ".join(f"{k} x{v}" for k, v in sorted(reasons.items()))
        print(f"| {name} | {mix} | {n} | {why} |", flush=True)


if __name__ == "__main__":
    main()

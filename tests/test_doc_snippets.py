"""Every ```python block of README.md and docs/*.md runs as written (each in a fresh
process, in an empty directory, CPU), and no module or doc cites a "DESIGN §n" the
repository does not have.

A block that cannot run here says so on its first line, visibly, with
``# not run by the tests: needs <what>`` (Megatron-LM's ``megatron.training``, a GPU, ...);
that list is kept tiny and checked below.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^# not run by the tests: needs (.+)$")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MAX_MARKED = 4


def _blocks() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            line = text[: m.start()].count("\n") + 1
            out.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1)))
    return out


BLOCKS = _blocks()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_doc_snippet_runs(tmp_path, where, code):
    first = code.splitlines()[0] if code.strip() else ""
    needs = MARKER.match(first)
    if needs:
        pytest.skip(f"{where} needs {needs.group(1)}")
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""),
    )
    assert out.returncode == 0, f"{where} failed:\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_doc_snippet_parses(where, code):
    """Every block is valid Python, the ones marked "not run" included (a reader pastes them)."""
    compile(code, where, "exec")


def test_marked_snippets_stay_few():
    marked = [w for w, c in BLOCKS if MARKER.match(c.splitlines()[0] if c.strip() else "")]
    assert len(marked) <= MAX_MARKED, marked


def test_no_design_section_citations():
    files = [*DOCS, *sorted((ROOT / "megatron_media_guard").rglob("*.py"))]
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    cited = [str(f.relative_to(ROOT)) for f in files if re.search(r"DESIGN\s*§", f.read_text())]
    assert cited == []

"""Every ```python block of README.md and docs/*.md runs as written (each in a fresh
process, in an empty directory, CPU) on the install the README says it needs (the blocks of
the docs it does not name as needing the [test] extra run with that extra's modules
unimportable, as after scripts/smoke.sh), and no module or doc cites a "DESIGN §n" the
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

# What only the [test] extra installs: a block of a doc the README does not name as needing it
# runs with these unimportable, as on the [megatron] install scripts/smoke.sh makes.
TEST_ONLY = ("transformers", "PIL", "safetensors", "hypothesis", "pytest")
BLOCKER = f"""import importlib.abc as _abc, sys as _sys
class _TestExtraOnly(_abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {TEST_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (the [test] extra)", name=name)
_sys.meta_path.insert(0, _TestExtraOnly())
del _abc, _sys, _TestExtraOnly
"""


def _needs_test_extra() -> set[str]:
    """The docs README's install paragraph names as needing the [test] extra."""
    text = (ROOT / "README.md").read_text()
    para = next((p for p in text.split("\n\n") if "Which install the examples need" in p), "")
    if "install.sh test" not in para:
        return set()
    named = para.split("The examples in", 1)[-1].split("they need the", 1)[0]
    return set(re.findall(r"`(docs/[A-Z_]+\.md)`", named))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_doc_snippet_runs(tmp_path, where, code):
    """Every block is valid Python, the ones marked "not run" included (a reader pastes them)."""
    compile(code, where, "exec")
    if needs := MARKER.match(code.split("\n", 1)[0]):
        pytest.skip(f"{where} needs {needs.group(1)}")
    doc = where.rsplit(":", 1)[0]
    prelude = "" if doc in _needs_test_extra() else BLOCKER
    out = subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""),
    )
    assert out.returncode == 0, f"{where} failed:\n{out.stderr[-3000:]}"


def test_marked_snippets_stay_few():
    marked = [w for w, c in BLOCKS if MARKER.match(c.split("\n", 1)[0])]
    assert len(marked) <= MAX_MARKED, marked


def test_no_design_section_citations():
    files = [*DOCS, *sorted((ROOT / "megatron_media_guard").rglob("*.py"))]
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    cited = [str(f.relative_to(ROOT)) for f in files if re.search(r"DESIGN\s*§", f.read_text())]
    assert cited == []

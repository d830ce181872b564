"""What a new user meets at the command line: ``media-guard replay`` and ``smoke`` on wrong
input say one line and exit 2 (replay's missing or unreadable bundles, ``--json`` too:
tests/test_hostile_replay.py), and the smoke job and the demo leave no temporary directory
behind (``--help`` imports no torch: tests/test_layout.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from family_checks import saved_bundle

from megatron_media_guard.cli import main
from megatron_media_guard.smoke import EXIT_USAGE
from megatron_media_guard.smoke import main as smoke_main

ROOT = Path(__file__).resolve().parents[1]


def run_ok(argv: list[str], timeout: int = 180, **env: str) -> subprocess.CompletedProcess:
    """``python argv`` in a fresh process with the worktree importable; it must exit 0."""
    cmd = [sys.executable, *argv]
    environ = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environ)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out


@pytest.mark.parametrize("value", ["0", "-5", "ten"])
def test_replay_max_bytes_must_be_a_positive_count(tmp_path, capsys, value):
    assert main(["replay", str(saved_bundle(tmp_path, environ={})), "--max-bytes", value]) == 2
    assert "--max-bytes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "under, needle",
    [
        ("taken", "exists and is not a directory"),
        ("taken/logs", "cannot create it"),
        ("ro/logs", "cannot create it"),
    ],
)
def test_smoke_log_dir_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, capsys, under, needle):
    if under.startswith("ro/") and os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    (tmp_path / "taken").write_text("x")  # a file, and a directory nobody may write into
    (tmp_path / "ro").mkdir(mode=0o500)
    path = tmp_path / under
    code = smoke_main(
        ["--nproc", "1", "--steps", "1", "--scenario", "none", "--log-dir", str(path)]
    )
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.strip().splitlines() == [err.strip()] and needle in err and str(path) in err, err


def _leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("media_guard_"))


@pytest.mark.timeout(200)
def test_smoke_without_log_dir_leaves_no_temp_dir_and_dump_dir_keeps_replayable_bundles(tmp_path):
    """``media-guard smoke --dump-dir DIR`` with no ``--log-dir``: the temporary logs go, and
    each run's mismatched micro-batches are saved under ``DIR/<scenario>.<policy>/`` (the
    worker's config used to ignore any dump directory), where ``media-guard replay``
    reproduces them."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = ["--nproc", "1", "--steps", "1", "--scenario", "budget_shrink", "--policy", "raise,drop"]
    dumps = ["--dump-dir", str(tmp_path / "dumps")]
    out = run_ok(["-m", "megatron_media_guard", "smoke", *run, *dumps], TMPDIR=str(tmp))
    assert "PASSED" in out.stdout and "--log-dir DIR" in out.stdout
    assert _leftovers(tmp) == []
    # no line points at a page that went with the temporary logs
    assert "file://" not in out.stdout and "removed with the temporary logs" in out.stdout
    # and the README says exactly that, in the words the run prints
    page = next(x for x in out.stdout.splitlines() if x.startswith("post-mortem page"))
    assert f"`{page}`" in (ROOT / "README.md").read_text()
    for run in ("budget_shrink.raise", "budget_shrink.drop"):
        (bundle,) = sorted((tmp_path / "dumps" / run).glob("*.bundle"))
        assert main(["replay", str(bundle)]) == 1  # the mismatch reproduces offline


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep", [False, True])
def test_demo_leaves_no_temp_dir(tmp_path, keep):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = ["--log-dir", str(tmp_path / "kept")] if keep else []
    run_ok([str(ROOT / "scripts" / "demo.py"), *argv], timeout=100, TMPDIR=str(tmp))
    assert _leftovers(tmp) == []
    assert (tmp_path / "kept" / "media_guard.rank00000.jsonl").is_file() == keep

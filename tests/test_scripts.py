"""The shell scripts off Linux x86_64: the install stamp is hashed without GNU coreutils'
``sha256sum`` (absent on macOS), and the megatron-core 0.19.2 step skips with a message where
its wheels cannot be used. Each script runs from a scratch copy, with shims first on PATH
standing in for the platform (``uname``) or hiding a tool; nothing of the checkout is touched."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _shim(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def _scratch(tmp_path: Path, script: str) -> Path:
    """A copy of the repository's top (pyproject.toml and the script) whose ``.venv/bin/python``
    runs this interpreter (a shim, so the real virtual environment is used and never written)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    shutil.copy(ROOT / "scripts" / script, repo / "scripts" / script)
    (repo / ".venv" / "bin").mkdir(parents=True)
    _shim(repo / ".venv" / "bin", "python", f'exec "{sys.executable}" "$@"')
    return repo


def _run(repo: Path, script: str, bindir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(
        ["bash", str(repo / "scripts" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_install_stamp_is_hashed_without_sha256sum(tmp_path):
    repo = _scratch(tmp_path, "install.sh")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("sha256sum", "shasum"):  # as on a machine without them
        _shim(bindir, tool, f'echo "{tool}: command not found" >&2; exit 127')
    version = subprocess.run(
        [repo / ".venv" / "bin" / "python", "--version"], capture_output=True, text=True
    ).stdout
    blob = b"".join(
        [
            (repo / "pyproject.toml").read_bytes(),
            (repo / "scripts" / "install.sh").read_bytes(),
            b"extra=test\n",
            version.encode(),
        ]
    )
    # the stamp an up-to-date install left: sha256 of the same bytes (what sha256sum printed)
    (repo / ".venv" / ".media_guard_install.test").write_text(hashlib.sha256(blob).hexdigest())
    out = _run(repo, "install.sh", bindir, "test")
    assert out.returncode == 0, out.stderr
    assert "up to date" in out.stderr and "installing" not in out.stderr


@pytest.mark.parametrize(
    "system, machine",
    [("Darwin", "arm64"), ("Darwin", "x86_64"), ("MINGW64_NT-10.0", "x86_64")],
)
def test_mcore019_step_skips_where_its_wheels_cannot_be_used(tmp_path, system, machine):
    repo = _scratch(tmp_path, "test_mcore019.sh")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _shim(bindir, "uname", f'case "$1" in -s) echo "{system}";; -m) echo "{machine}";; esac')
    out = _run(repo, "test_mcore019.sh", bindir)
    assert out.returncode == 0, out.stderr
    assert f"[mcore019] SKIPPED: no megatron-core 0.19.2 / triton wheel for {system} {machine}" in (
        out.stderr
    )
    assert "required on Linux x86_64 only" in out.stderr
    assert not (repo / ".mcore019").exists()  # nothing downloaded, no test run
    assert not (repo / ".bridge062").exists()

"""The shell scripts off Linux x86_64: the install stamp is hashed without GNU coreutils'
``sha256sum`` (absent on macOS), and the megatron-core 0.19.2 step skips with a message where
its wheels cannot be used. Each script runs from a scratch copy, with shims first on PATH
standing in for the platform (``uname``) or hiding a tool; nothing of the checkout is touched."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shlex
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


def _scratch(tmp_path: Path, script: str, python: str | None = f'exec "{sys.executable}" "$@"'):
    """A copy of the repository's top (pyproject.toml and the script) whose ``.venv/bin/python``
    is the shim ``python`` (None: no virtual environment; by default this interpreter, so the
    real one is used and never written), and an empty ``tmp_path/bin`` for the tests' shims."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    shutil.copy(ROOT / "scripts" / script, repo / "scripts" / script)
    if python is not None:
        (repo / ".venv" / "bin").mkdir(parents=True)
        _shim(repo / ".venv" / "bin", "python", python)
    return repo


def _run(repo: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``bash script args`` with ``tmp_path/bin`` first on PATH and ``env`` set."""
    path = f"{repo.parent / 'bin'}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        ["bash", str(repo / "scripts" / script), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PATH=path, **env),
        timeout=240,  # the 0.19.2 version line imports megatron-core: slow on a loaded machine
        cwd=repo.parent,
    )


def test_install_stamp_is_hashed_without_sha256sum(tmp_path):
    repo = _scratch(tmp_path, "install.sh")
    for tool in ("sha256sum", "shasum"):  # as on a machine without them
        _shim(tmp_path / "bin", tool, f'echo "{tool}: command not found" >&2; exit 127')
    version = subprocess.run(
        [repo / ".venv" / "bin" / "python", "--version"], capture_output=True, text=True
    ).stdout
    stamped = (repo / "pyproject.toml", repo / "scripts" / "install.sh")
    blob = b"".join(p.read_bytes() for p in stamped) + b"extra=test\n" + version.encode()
    # the stamp an up-to-date install left: sha256 of the same bytes (what sha256sum printed)
    (repo / ".venv" / ".media_guard_install.test").write_text(hashlib.sha256(blob).hexdigest())
    out = _run(repo, "install.sh", "test")
    assert out.returncode == 0, out.stderr
    assert "up to date" in out.stderr and "installing" not in out.stderr


@pytest.mark.parametrize(
    "system, machine",
    [("Darwin", "arm64"), ("Darwin", "x86_64"), ("MINGW64_NT-10.0", "x86_64")],
)
def test_mcore019_step_skips_where_its_wheels_cannot_be_used(tmp_path, system, machine):
    repo = _scratch(tmp_path, "test_mcore019.sh")
    uname = f'case "$1" in -s) echo "{system}";; -m) echo "{machine}";; esac'
    _shim(tmp_path / "bin", "uname", uname)
    out = _run(repo, "test_mcore019.sh")
    assert out.returncode == 0, out.stderr
    assert f"[mcore019] SKIPPED: no megatron-core 0.19.2 / triton wheel for {system} {machine}" in (
        out.stderr
    )
    assert "required on Linux x86_64 only" in out.stderr
    assert not (repo / ".mcore019").exists()  # nothing downloaded, no test run
    assert not (repo / ".bridge062").exists()


@pytest.mark.parametrize(
    "venv_python, rc, needle",
    [
        (None, 2, "no Python at .venv/bin/python: run 'bash scripts/install.sh test'"),
        ('[ "$1" = -c ] && exit 1; exit 0', 2, ".venv/bin/python has no torch"),
        # the project's python runs (no CUDA here: the script stops at its CUDA check, rc 2)
        (f'echo "venv python $*" >&2; exec "{sys.executable}" "$@"', 2, "venv python -c"),
    ],
)
def test_gpu_check_uses_the_project_venv(tmp_path, venv_python, rc, needle):
    """gpu_check.sh runs ./.venv/bin/python, not the system python3 (a machine without a
    global torch got a raw ModuleNotFoundError), and says so when it is missing."""
    repo = _scratch(tmp_path, "gpu_check.sh", venv_python)
    _shim(tmp_path / "bin", "python3", 'echo "system python3 used" >&2; exit 99')
    # never the real GPU run, even on a GPU machine; PYTHON unset (the script's override)
    out = _run(repo, "gpu_check.sh", CUDA_VISIBLE_DEVICES="", PYTHON="")
    assert "system python3 used" not in out.stderr
    assert out.returncode == rc and needle in out.stderr + out.stdout, (out.stdout, out.stderr)


def test_mcore019_version_line_names_megatron_cores_version_alone(tmp_path):
    """megatron.core.__version__ appends ``git rev-parse HEAD`` of the working directory (this
    repository's commit, e.g. "0.19.2+f25b802"): the script's line names the wheel's version."""
    if not (ROOT / ".mcore019" / ".version").is_file() or not (ROOT / ".bridge062").is_dir():
        pytest.skip("megatron-core 0.19.2 / Bridge 0.6.2 not unpacked (scripts/test_mcore019.sh)")
    if shutil.which("git") is None:
        pytest.skip("no git: the suffix megatron-core appends cannot occur")
    repo = _scratch(tmp_path, "test_mcore019.sh")
    for name in (".mcore019", ".bridge062", "megatron_media_guard"):
        (repo / name).symlink_to((ROOT / name).resolve())
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    out = _run(repo, "test_mcore019.sh", "--version")  # pytest --version: no tests
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("megatron-core "))
    assert line.split()[1] == "0.19.2", line


@pytest.mark.parametrize(
    "args, log_dir, dump_dir",
    [
        ([], "media_guard_logs/smoke-*", "media_guard_logs/smoke-*/bundles"),
        (["--log-dir", "out"], "out", "out/bundles"),
        (["--log-dir=out", "--steps", "2"], "out", "out/bundles"),
        (["--dump-dir", "b"], "media_guard_logs/smoke-*", "b"),
        (["--log-dir", "out", "--dump-dir="], "out", ""),
    ],
)
def test_smoke_sh_keeps_logs_page_and_bundles_by_default(tmp_path, args, log_dir, dump_dir):
    """scripts/smoke.sh (the main job) keeps what the README shows: the logs and their page in
    a fresh directory, and the replay bundles in its bundles/ (``media-guard smoke`` alone uses
    a temporary directory)."""
    repo = _scratch(tmp_path, "smoke.sh")
    _shim(repo / "scripts", "install.sh", "exit 0")
    _shim(repo / ".venv" / "bin", "media-guard", 'printf "%s\\n" "$@" > "$(dirname "$0")/argv"')
    out = _run(repo, "smoke.sh", *args)
    assert out.returncode == 0, out.stderr
    argv = (repo / ".venv" / "bin" / "argv").read_text().splitlines()
    assert argv[0] == "smoke"

    def value(flag):
        got = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
        got += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
        assert len(got) == 1, (flag, argv)
        return got[0]

    assert fnmatch.fnmatch(value("--log-dir"), log_dir), shlex.join(argv)
    assert fnmatch.fnmatch(value("--dump-dir"), dump_dir), shlex.join(argv)

"""core/providers.py: what the core calls but may not import (the default consensus and rank
from ranks/, the replay-bundle writer from replay/) is found by every guard built through the
package's public names or an adapter, and the core alone imports neither."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
{imports}
from megatron_media_guard.core import providers
print("PROVIDED:" + ",".join(sorted(providers._PROVIDED)))
print("RANKS:" + str("megatron_media_guard.ranks" in sys.modules))
print("REPLAY:" + str("megatron_media_guard.replay" in sys.modules))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "imports,provided",
    [
        # the public name: the package __init__ imports both providers first
        ("from megatron_media_guard import MediaGuard", "bundle,process"),
        ("import megatron_media_guard as m\nm.check_batch", "bundle,process"),
        # a from-import of the lazily loaded names (the package alone loads no torch: test_layout)
        (
            "from megatron_media_guard import install_vlm, install_from_args, check_batch\n"
            "from megatron_media_guard import MediaGuardError, MediaAlignmentError\n"
            "from megatron_media_guard import MediaInputError, GuardConfig",
            "bundle,process",
        ),
        ("import megatron_media_guard.adapters", "bundle,process"),  # every adapter
        ("from megatron_media_guard.adapters.vlm_install import install_vlm", "bundle,process"),
        ("from megatron_media_guard.ranks.defaults import default_consensus", "process"),
        ("from megatron_media_guard.ranks.consensus import StageConsensus", "process"),
        ("from megatron_media_guard.replay.bundle_save import save_bundle", "bundle"),
        # the core alone: it imports neither ranks/ nor replay/, so nothing is provided
        ("from megatron_media_guard.core.guard import MediaGuard", ""),
        ("from megatron_media_guard import GuardConfig", ""),  # torch-free names load neither
    ],
)
def test_providers_register_where_guards_are_built(imports, provided):
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(imports=imports)],
        capture_output=True,
        text=True,
        timeout=160,
        check=True,
    ).stdout
    lines = dict(x.split(":", 1) for x in out.splitlines() if ":" in x)
    assert lines["PROVIDED"] == provided, out
    assert lines["RANKS"] == str("process" in provided), out
    assert lines["REPLAY"] == str("bundle" in provided), out


CORE_ALONE = """
import os, tempfile
os.environ["RANK"], os.environ["WORLD_SIZE"] = "3", "4"
import torch
from megatron_media_guard.core.guard import MediaGuard
from megatron_media_guard.core.grammar import Grammar
from megatron_media_guard.config import GuardConfig
from megatron_media_guard.core.items import MediaItem
d = tempfile.mkdtemp()
g = MediaGuard(GuardConfig(policy="drop", dump_dir=d), Grammar.qwen2_vl())
P, S, E = 151655, 151652, 151653
ids = torch.tensor([[1, S, P, P, E, 2]])
item = MediaItem(num_features=3, sample=0)  # 2 placeholders: a mismatch
res = g.merge(torch.zeros(1, 6, 4), ids, torch.ones(3, 4), [item])
print("RANK:" + str(g.rank.rank), "CONSENSUS:" + str(g.consensus), "ACTIONS:" + ",".join(res.report.actions))
print("BUNDLES:" + str(len(os.listdir(d))))
"""


@pytest.mark.timeout(180)
def test_a_guard_whose_core_was_imported_alone_is_single_process():
    """Without ranks/ and replay/ (nothing above the core imported): the rank from ``RANK``,
    no consensus (a warning: WORLD_SIZE says other processes run), and a mismatch still handled
    by the policy; the bundle is not written (one error line says why), the call goes on."""
    done = subprocess.run(
        [sys.executable, "-c", CORE_ALONE], capture_output=True, text=True, timeout=160
    )
    assert done.returncode == 0, done.stderr
    out = dict(x.split(":", 1) for x in done.stdout.split() if ":" in x)
    assert out["RANK"] == "3" and out["CONSENSUS"] == "None", done.stdout
    assert out["ACTIONS"] == "drop" and out["BUNDLES"] == "0", done.stdout
    assert "no bundle writer" in done.stderr, done.stderr
    assert "WORLD_SIZE=4 but no default consensus is registered" in done.stderr, done.stderr

"""Policy repair end to end on CPU: a small real vision tower (patch embedding, torch
transformer layers, megatron-core's MultimodalProjector) re-encodes only the budget-shrunk
video to the engine's count; the aligned image is untouched and gradients flow."""

from __future__ import annotations

import pytest
import torch
from family_checks import records
from torch import nn

from megatron_media_guard import GuardConfig, MediaGuard, MediaItem
from megatron_media_guard.diagnostics import RankInfo
from megatron_media_guard.geometry import PatchMergeGeometry, Solution
from megatron_media_guard.repair.pixels import from_frames
from megatron_media_guard.testing import TEST_GRAMMARS, build_batch

Q = TEST_GRAMMARS["qwen"]
H = 32
GEO = PatchMergeGeometry(
    patch=14, merge=2, temporal_patch=2, min_pixels=28 * 28, max_pixels=420 * 420
)


@pytest.fixture(scope="module")
def projector(tmp_path_factory):
    """megatron-core's MultimodalProjector needs model-parallel state: one gloo rank."""
    dist = pytest.importorskip("torch.distributed")
    ps = pytest.importorskip("megatron.core.parallel_state")
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    store = tmp_path_factory.mktemp("store") / "pg"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    try:
        torch.manual_seed(0)
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=1,
            ffn_hidden_size=H,
            use_cpu_initialization=True,
            add_bias_linear=True,
        )
        sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        yield MultimodalProjector(cfg, sub, "mlp", input_size=4 * 24)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


class Tower(nn.Module):
    """Qwen-style: patches [n, 3*2*14*14] -> embed -> 2 transformer layers -> 2x2 merge -> projector."""

    def __init__(self, projector: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Linear(3 * 2 * 14 * 14, 24)
        layer = nn.TransformerEncoderLayer(24, 2, 48, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.projector = projector
        self.calls = 0

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.layers(self.embed(patches).unsqueeze(0))[0]
        x = x.reshape(-1, 4 * 24)  # the processor orders patches in 2x2 merge groups
        return self.projector(x)


def _item(frames: torch.Tensor, sample: int, modality: str) -> MediaItem:
    pixels, kw = from_frames(frames, "qwen_patches")
    grid = tuple(int(v) for v in kw["grid_thw"][0])
    hw = tuple(frames.shape[-2:])
    return MediaItem(
        grid[0] * (grid[1] // 2) * (grid[2] // 2),
        sample=sample,
        modality=modality,
        sample_id=f"s{sample}",
        num_frames=frames.shape[0],
        frame_hw=hw,
        pixels=pixels,
        layout="qwen_patches",
        grid_thw=grid,
        source_hw=hw,
    )


def _scenario(tower):
    torch.manual_seed(2)
    image = _item(torch.randn(2, 3, 112, 112), 0, "image")  # 16 tokens, aligned
    video_frames = torch.randn(4, 3, 280, 420)
    video = _item(video_frames, 1, "video")  # trainer: 2 groups x 10x15 = 300 tokens
    engine = GEO.tokens((280, 420), num_frames=4, max_pixels=196 * 308)  # the engine's budget
    assert engine < video.num_features
    batch = build_batch(Q, [[("image", image.num_features)], [("video", engine)]])
    feats = torch.cat([tower(it.pixels, torch.tensor([it.grid_thw])) for it in (image, video)])
    return batch, [image, video], feats, engine


def _guard(tmp_path, encoder=None, geometry=GEO, **config) -> MediaGuard:
    cfg = GuardConfig(policy="repair", log_dir=str(tmp_path), **config)
    return MediaGuard(cfg, grammar=Q, rank=RankInfo(rank=0), geometry=geometry, encoder=encoder)


def test_repair_reencodes_only_the_mismatched_item(projector, tmp_path):
    tower = Tower(projector)
    batch, items, feats, engine = _scenario(tower)
    tower.calls = 0
    b, s = batch.input_ids.shape
    emb = torch.randn(b, s, H)
    guard = _guard(tmp_path, tower)
    res = guard.merge(emb, batch.input_ids, feats, items, loss_mask=torch.ones(b, s), step=5)
    assert res.report.actions == ("keep", "repair")
    assert res.report.repaired == (1,)
    assert tower.calls == 1  # only the video was re-encoded
    ph = torch.isin(batch.input_ids, torch.tensor([5, 6]))
    # the aligned image is bit-identical to an unrepaired merge
    assert torch.equal(res.embeddings[0][ph[0]], feats[: items[0].num_features])
    assert torch.equal(res.embeddings[0][~ph[0]], emb[0][~ph[0]])
    # the video's placeholders hold its re-encoded features, exactly the engine's count
    assert int(ph[1].sum()) == engine
    assert not torch.equal(res.embeddings[1][ph[1]][:5], feats[16:21])
    assert res.loss_mask.eq(1).all()
    # gradients reach the tower through the repaired features
    res.embeddings[1][ph[1]].sum().backward()
    assert tower.embed.weight.grad is not None and tower.embed.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in projector.parameters())
    # the repair is in the per-rank log with target, grid, fidelity and duration
    (r,) = [r for r in records(tmp_path) if r["event"] == "repair"]
    assert (r["sample"], r["item"], r["expected"], r["got"]) == (1, 1, [engine], [300])
    assert r["fidelity"] == "engine-replay" and r["action"] == "repair"
    assert r["grid"] and r["duration_ms"] > 0 and r["step"] == 5


@pytest.mark.parametrize(
    ("config", "encoder_fails", "reason"),
    [
        ({"allowed_fidelity": ("unique",)}, False, "fidelity engine-replay not allowed"),
        ({}, True, "re-encoding failed: RuntimeError: CUDA out of memory"),
    ],
)
def test_repair_falls_back_and_says_why(projector, tmp_path, config, encoder_fails, reason):
    tower = Tower(projector)
    batch, items, feats, _ = _scenario(tower)

    def encoder(pixels, grid_thw):
        if encoder_fails:
            raise RuntimeError("CUDA out of memory (simulated)")
        return tower(pixels, grid_thw)

    guard = _guard(tmp_path, encoder, fallback="drop", **config)
    res = guard.merge(torch.randn(*batch.input_ids.shape, H), batch.input_ids, feats, items)
    assert res.report.actions == ("keep", "drop")
    rep = next(r for r in records(tmp_path) if r["event"] == "repair")
    assert rep["action"] == "fallback:drop" and reason in rep["reason"]


def test_unrepairable_status_takes_the_fallback(tmp_path):
    batch = build_batch(Q, [[("image", 4), ("image", 6)]])
    items = [MediaItem(6, 0), MediaItem(4, 0)]  # swapped: resizing would train on wrong media
    res = _guard(tmp_path, fallback="drop").merge(
        torch.randn(1, batch.input_ids.shape[1], H), batch.input_ids, torch.randn(10, H), items
    )
    assert res.report.actions == ("drop",) and res.report.repaired == ()


def test_repair_without_encoder_falls_back_with_reason(tmp_path):
    batch = build_batch(Q, [[("image", 4)]])
    emb = torch.randn(1, batch.input_ids.shape[1], H)
    no_encoder = r"surplus(.|\n)*repair failed, item 0: cannot repair: no encoder"
    with pytest.raises(Exception, match=no_encoder):
        _guard(tmp_path, fallback="raise").merge(
            emb, batch.input_ids, torch.randn(5, H), [MediaItem(5, 0)]
        )
    rec = records(tmp_path)
    assert "no encoder, pixels" in next(r for r in rec if r["event"] == "repair")["reason"]


def test_a_geometry_that_breaks_its_contract_falls_back(tmp_path):
    """A user geometry whose solution claims another count: the re-encoded rows are counted
    against the placeholders before they are merged, so nothing shifts into text."""

    class LyingGeometry:
        def solve(self, target, hw, num_frames=1, *, hw_kind="source"):
            return Solution(
                tokens=target + 1, size_hw=(28, 28), fidelity="unique", reason="x", grid=(2, 2)
            )

    batch = build_batch(Q, [[("image", 3)], [("image", 2)]])
    items = [MediaItem(2, 0, pixels=torch.randn(3, 28, 28), frame_hw=(28, 28)), MediaItem(2, 1)]

    def encoder(pixels):
        return torch.full((4, H), 77.0)

    g = _guard(tmp_path, encoder, LyingGeometry(), fallback="drop")
    emb = torch.randn(*batch.input_ids.shape, H)
    feats = torch.randn(4, H)
    res = g.merge(emb, batch.input_ids, feats, items)
    assert res.report.actions == ("drop", "keep")
    ph = torch.isin(batch.input_ids, torch.tensor([5]))
    assert torch.equal(res.embeddings[1][ph[1]], feats[2:])
    assert torch.equal(res.embeddings[1][~ph[1]], emb[1][~ph[1]])

"""GPU timings for scripts/gpu_check.sh: aligned merge ratio and one re-projection on CUDA."""

from __future__ import annotations

import torch

from megatron_media_guard import GuardConfig, MediaGuard
from megatron_media_guard.core.grammar import Grammar
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.repair.pixels import from_frames
from megatron_media_guard.repair.reproject import reencode
from megatron_media_guard.testing import build_batch


def _time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    dev = torch.device("cuda")
    g = Grammar.qwen2_vl()
    b, s, h = 4, 16384, 1024
    per = (s - 8) // 64 - 5
    batch = build_batch(g, [[("image", per)] * 64] * b, seq_len=s, text=2)
    ids = batch.input_ids.to(dev)
    emb = torch.randn(b, s, h, dtype=torch.bfloat16, device=dev)
    feats = torch.randn(
        sum(i.num_features for i in batch.items), h, dtype=torch.bfloat16, device=dev
    )
    guard = MediaGuard(GuardConfig(), grammar=g)
    pad = g.placeholders["image"]
    t_ref = _time(lambda: emb.masked_scatter((ids == pad).unsqueeze(-1), feats))
    t_guard = _time(lambda: guard.merge(emb, ids, feats, batch.items))
    with count_transfers() as seen:
        guard.merge(emb, ids, feats, batch.items)
    print(
        f"merge b={b} s={s} h={h} bf16: unguarded {t_ref:.3f} ms, guarded {t_guard:.3f} ms, "
        f"ratio {t_guard / t_ref:.3f}, transfers {sum(seen.values())}"
    )

    frames = torch.randn(2, 3, 1092, 2408, device=dev)
    pixels, kw = from_frames(frames, "qwen_patches")
    lin = torch.nn.Linear(pixels.shape[1], 256, device=dev)

    def encoder(p, grid_thw):
        return lin(p).reshape(-1, 4, 256).mean(1)

    class Target:
        tokens = 1 * (966 // 28) * (2128 // 28)
        size_hw = (966, 2128)

    t = _time(
        lambda: reencode(
            pixels, "qwen_patches", Target, encoder, grid_thw=kw["grid_thw"][0].tolist()
        ),
        10,
    )
    print(f"reencode 1092x2408 -> 966x2128 on {torch.cuda.get_device_name(0)}: {t:.2f} ms")


if __name__ == "__main__":
    main()

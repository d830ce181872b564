"""Consensus cost per guarded merge on 4 gloo ranks (TP2 x DP2), aligned path.

Target (docs/BENCHMARKS.md): at most two small all-reduces (<= 8 integers each) per guarded
merge on the aligned path. ``StageConsensus`` makes one: 7 int64 over the stage
group. Also timed, per rank, median over reps, interleaved: the guarded merge alone
(no consensus), the same merge with the consensus, and ``agree`` alone (the
all-reduce round trip, including the wait for the slowest rank). The rows report
the median over ranks. CPU, gloo over loopback, 1 torch thread per rank; on a 2-core
machine 4 ranks share 2 cores, so the round trip includes scheduling delays.

Run: ``python -m benchmarks.bench_consensus`` (or ``python -m benchmarks --only consensus``).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as tmp

WORLD = 4


def _rank(rank: int, world: int, workdir: str, reps: int, b: int, s: int, h: int) -> None:
    import torch.distributed as dist

    from megatron_media_guard import GuardConfig, MediaGuard
    from megatron_media_guard.core.outcome import LocalOutcome
    from megatron_media_guard.diagnostics import RankInfo
    from megatron_media_guard.ranks.consensus import _FIELDS, StageConsensus
    from megatron_media_guard.testing import TEST_GRAMMARS, build_batch

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # TP peers hold one micro-batch
    cons = StageConsensus(batch_group=groups[rank // 2])
    q = TEST_GRAMMARS["qwen"]
    runs = max(1, s // 256)  # ~16 runs of ~200 placeholders per row at s=4096
    batch = build_batch(q, [[("image", 200)] * runs] * b, seq_len=s, seed=rank // 2)
    info = RankInfo(rank=rank)
    plain = MediaGuard(GuardConfig(), q, rank=info)
    guarded = MediaGuard(GuardConfig(), q, rank=info, consensus=cons)
    emb = torch.randn(b, s, h)
    feats = batch.features(h)
    args = (emb, batch.input_ids, feats, batch.items)
    for _ in range(3):
        plain.merge(*args)
        guarded.merge(*args)
    rep = guarded.merge(*args).report
    local = LocalOutcome(rep.step, rep.microbatch, rep.digest, rep.num_samples, 0, 0, 0, False)
    dist.barrier()
    before = cons.collectives
    times: dict[str, list[float]] = {"merge": [], "merge_consensus": [], "agree": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        plain.merge(*args)
        t1 = time.perf_counter()
        guarded.merge(*args)
        t2 = time.perf_counter()
        cons.agree(local)
        t3 = time.perf_counter()
        times["merge"].append(t1 - t0)
        times["merge_consensus"].append(t2 - t1)
        times["agree"].append(t3 - t2)
    per_merge = (cons.collectives - before) / (2 * reps)
    raw = torch.zeros(len(_FIELDS), dtype=torch.int64)
    times["agree_back_to_back"], times["all_reduce"] = [], []
    dist.barrier()
    for _ in range(reps):  # alternate, so load drift hits both alike
        t0 = time.perf_counter()
        cons.agree(local)
        t1 = time.perf_counter()
        dist.all_reduce(raw)
        times["agree_back_to_back"].append(t1 - t0)
        times["all_reduce"].append(time.perf_counter() - t1)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["collectives_per_merge"] = per_merge
    out["payload"] = len(_FIELDS)
    (Path(workdir) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def run(quick: bool = False) -> list[dict]:
    b, s, h = 2, 4096, 256
    reps = 20 if quick else 200
    with tempfile.TemporaryDirectory(prefix="bench_consensus_") as workdir:
        tmp.start_processes(
            _rank,
            args=(WORLD, workdir, reps, b, s, h),
            nprocs=WORLD,
            join=True,
            start_method="spawn",
        )
        per_rank = [json.loads((Path(workdir) / f"rank{r}.json").read_text()) for r in range(WORLD)]
    med = {k: statistics.median(r[k] for r in per_rank) for k in per_rank[0]}
    where = f"4 gloo ranks TP2xDP2, b={b} s={s} h={h} fp32, {reps} reps, median over ranks"
    return [
        {
            "benchmark": "consensus",
            "metric": "collectives per guarded merge (aligned)",
            "value": med["collectives_per_merge"],
            "target": "<= 2",
            "note": "one all-reduce (SUM) over the stage group",
        },
        {
            "benchmark": "consensus",
            "metric": "integers per all-reduce",
            "value": med["payload"],
            "target": "<= 8",
            "note": "2 check lanes + samples, mismatched, dropped, repaired, fatal",
        },
        {
            "benchmark": "consensus",
            "metric": "guarded merge alone (ms)",
            "value": med["merge"],
            "target": "info",
            "note": where,
        },
        {
            "benchmark": "consensus",
            "metric": "agree() back to back (ms)",
            "value": med["agree_back_to_back"],
            "target": "info",
            "note": "the all-reduce round trip itself (ranks already in step)",
        },
        {
            "benchmark": "consensus",
            "metric": "bare all_reduce of 7 int64 (ms)",
            "value": med["all_reduce"],
            "target": "info",
            "note": "the floor agree() pays; the rest is hashing and bookkeeping",
        },
        {
            "benchmark": "consensus",
            "metric": "agree() / merge time",
            "value": med["agree_back_to_back"] / med["merge"],
            "target": "info",
            "note": "collective cost relative to the merge it guards",
        },
        {
            "benchmark": "consensus",
            "metric": "agree() after each merge (ms)",
            "value": med["agree"],
            "target": "info",
            "note": "includes waiting for the slowest rank's merge (load skew; 4 ranks on "
            f"{os.cpu_count()} cores); merge with consensus {med['merge_consensus']:.3g} ms",
        },
    ]


if __name__ == "__main__":
    for row in run():
        print(row)

"""One rank of the smoke job: process group, megatron-core parallel_state, the tiny model,
then every scenario x policy for a few real training steps under the guard.

A scenario that is expected to raise does so on every rank of the stage in the same
collective (the guard's consensus), so each rank catches the error, records it and goes
on with the next scenario on the same process group. Rank 0 prints one progress line per
step. What each rank saw comes back to the launcher as a :class:`RankResult`.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

with warnings.catch_warnings():  # megatron-core warns about missing TE/Apex on import
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state

    from .model import TinyVLM, param_checksum, sync_gradients

from ..config import GuardConfig
from ..core.guard import MediaGuard
from ..diagnostics import LOGGER_NAME, get_logger
from ..errors import MediaGuardError
from ..ranks.consensus import StageConsensus
from ..replay import bundle_save as _bundle_writer  # noqa: F401  (core/providers.py)
from .runspec import Observation, RankResult, WorkerArgs
from .scenarios import GEOMETRY, GRAMMAR, micro_batch

PROGRESS = "[smoke]"


def rank_main(args: WorkerArgs) -> RankResult:
    """Entry point of one rank (started by the launcher with RANK / WORLD_SIZE / LOCAL_RANK /
    MASTER_ADDR / MASTER_PORT in the environment)."""
    warnings.filterwarnings("ignore")
    if not args.verbose:
        get_logger()
        logging.getLogger(LOGGER_NAME).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=1
        )
        return _Rank(args, device).run()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class _Rank:
    def __init__(self, args: WorkerArgs, device: torch.device):
        self.args = args
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.dp = parallel_state.get_data_parallel_rank()
        self.tp = parallel_state.get_tensor_model_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        dps = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.world)]
        dist.all_gather(dps, torch.tensor([self.dp], device=device))
        self.fault_dp = int(dps[args.fault_rank].item())
        torch.manual_seed(1234 + args.seed)  # identical replicas on every data-parallel rank
        self.model = TinyVLM(tp=args.tp).to(device)
        self.initial = copy.deepcopy(self.model.state_dict())

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"{PROGRESS} {text}", flush=True)

    def run(self) -> RankResult:
        a = self.args
        total = len(a.scenarios) * len(a.policies)
        k = 0
        obs = []
        for scenario in a.scenarios:
            for policy in a.policies:
                k += 1
                counter = f"[{k:>{len(str(total))}}/{total}]"
                obs.append(self.scenario(scenario, policy, counter))
                if a.hang_rank == self.rank:
                    time.sleep(10**6)
        return RankResult(self.rank, self.tp, self.dp, self.world, str(self.device), tuple(obs))

    def scenario(self, scenario: str, policy: str, counter: str) -> Observation:
        a = self.args
        t0 = time.perf_counter()
        name = f"{scenario}/{policy}"
        consensus = StageConsensus.from_parallel_state()
        run = f"{scenario}.{policy}"
        guard = MediaGuard(
            GuardConfig(  # environ={}: the scenarios' expectations hold whatever is exported
                policy=policy,
                log_dir=str(Path(a.log_dir) / run),
                dump_dir=None if a.dump_dir is None else str(Path(a.dump_dir) / run),
                environ={},
            ),
            GRAMMAR,
            rank=consensus.rank_info(),
            consensus=consensus,
            geometry=GEOMETRY,
            encoder=self.model.encode,
        )
        consensus.bind(guard)
        self.model.load_state_dict(self.initial)
        opt = torch.optim.SGD(self.model.parameters(), lr=a.lr)
        losses: list[float] = []
        drops, repairs, injected = [], [], []
        err: MediaGuardError | None = None
        raised_step = None
        for step in range(a.steps):
            faulty = self.dp == self.fault_dp and step == a.fault_step
            mb = micro_batch(scenario if faulty else "none", self.dp, step, a.seed)
            if mb.faulty_samples:
                injected.append((step, mb.faulty_samples))
            mb = replace(mb, input_ids=mb.input_ids.to(self.device))
            try:
                opt.zero_grad()
                loss, res = self.model(mb, guard, step, mb.pixels(self.device))
                loss.backward()
                sync_gradients(self.model, self.dp_group)
                opt.step()
                guard.on_step_end(step)
            except MediaGuardError as exc:
                err, raised_step = exc, step
                self.say(
                    f"{counter} {name:<28} step {step}  RAISED {_culprit_text(exc, self.rank)}"
                )
                break
            losses.append(float(loss.detach()))
            rep = res.report
            if rep.dropped:
                drops.append((step, tuple(rep.dropped)))
            if rep.repaired:
                repairs.append((step, tuple(rep.repaired)))
            st = rep.stage
            stage = (
                f"stage: {st.mismatched} mismatched, {st.dropped} dropped, {st.repaired} repaired"
                if st is not None
                else ""
            )
            self.say(f"{counter} {name:<28} step {step}  loss {losses[-1]:.4f}  {stage}")
        guard.log.close()
        culprit = None
        if err is not None:
            culprit = err.context.get("culprit_rank", self.rank)
            culprit = int(culprit) if isinstance(culprit, int) else None
        ob = Observation(
            scenario=scenario,
            policy=policy,
            rank=self.rank,
            steps_done=len(losses),
            losses=tuple(losses),
            drops=tuple(drops),
            repairs=tuple(repairs),
            injected=tuple(injected),
            raised_step=raised_step,
            error_type=type(err).__name__ if err is not None else None,
            error=str(err).splitlines()[0][:300] if err is not None else None,
            culprit=culprit,
            names_culprit=err is not None and f"rank {culprit}" in str(err),
            in_sync=self.in_sync(),
            seconds=time.perf_counter() - t0,
        )
        self.summary_line(ob, counter, name)
        return ob

    def in_sync(self) -> bool:
        """Data-parallel replicas hold identical parameters (one all-reduce)."""
        c = param_checksum(self.model)
        t = torch.tensor([c, -c], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        return bool(t[0].item() == -t[1].item())

    def summary_line(self, ob: Observation, counter: str, name: str) -> None:
        """Rank 0 prints the stage-wide outcome (one all-gather of 5 ints)."""
        row = torch.tensor(
            [
                ob.raised_step if ob.raised_step is not None else -1,
                ob.culprit if ob.culprit is not None else -1,
                ob.steps_done,
                sum(len(s) for _, s in ob.drops),
                sum(len(i) for _, i in ob.repairs),
            ],
            device=self.device,
        )
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row)
        if self.rank != 0:
            return
        table = torch.stack(rows).cpu().tolist()
        raised = [r for r, v in enumerate(table) if v[0] >= 0]
        if raised:
            at = ",".join(str(s) for s in sorted({table[r][0] for r in raised}))
            named = ",".join(str(c) for c in sorted({table[r][1] for r in raised}))
            text = f"{len(raised)}/{self.world} ranks raised at step {at} naming rank {named}"
        else:
            text = f"{min(v[2] for v in table)}/{self.args.steps} steps on every rank"
        drops = {r: v[3] for r, v in enumerate(table) if v[3]}
        fixed = {r: v[4] for r, v in enumerate(table) if v[4]}
        if drops:
            text += f"; samples dropped by rank {drops}"
        if fixed:
            text += f"; items repaired by rank {fixed}"
        self.say(f"{counter} {name:<28} done: {text} ({ob.seconds:.2f} s)")
        sys.stdout.flush()


def _culprit_text(err: MediaGuardError, rank: int) -> str:
    c = err.context.get("culprit_rank", rank)
    head = " ".join(str(err).split())
    head = head if len(head) <= 160 else head[:157] + "..."
    return f"{type(err).__name__} naming rank {c}: {head}"

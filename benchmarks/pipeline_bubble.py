"""Pipeline bubble: the measured idle fraction of each rank per schedule, against theory.

    python benchmarks/pipeline_bubble.py                  # ~6 min on 2 cores: both modes
    python benchmarks/pipeline_bubble.py --mode timed     # only the load-proof part (~3 min)
    python benchmarks/pipeline_bubble.py --quick          # ~1 min check that it runs
    python benchmarks/pipeline_bubble.py --json bubble.json

Each configuration runs polytrain's pipeline (`PipelineRunner.train_step`, the code the
trainer runs) on gloo ranks, one thread each. Every compute call of every stage
(forward, full backward, input-gradient and weight-gradient backward, the loss) is timed
on the rank that runs it; a step is timed between two barriers, so its wall time is the
whole pipeline's. Per rank:

    measured idle = 1 - (time in compute) / (step wall time)

against two references:

- theory: (p-1)/(m+p-1) for GPipe and 1F1B (p ranks, m micro-batches); (p-1)/(v m + p-1)
  for interleaved 1F1B with v stages per rank; 0 for ZB-V when forward, input-gradient
  and weight-gradient passes take equal time (the zero-bubble paper's setting).
- schedule: the idle fraction the schedule's own order of operations gives with the
  measured durations of its operations and instant communication: each rank runs its
  recorded operations in order, each as soon as its input (the previous stage's forward,
  the next stage's backward) is done. Measured minus this is the runtime's overhead
  (communication, Python, waiting on a busy machine).

Two modes, because a 2-core machine cannot run 4 busy ranks fairly:
- `timed`: each stage is a module whose forward, input-gradient and weight-gradient
  passes take fixed times (they sleep: F = I = W = `--op-ms` / v), so the ranks do not
  compete for cores and the measurement sees the schedule and the runtime, not the
  machine; p = 2 and 4.
- `compute`: a real Llama split into stages by polytrain (its blocks dominate the
  compute: small vocabulary), p = 2 ranks on the 2 cores, one thread each; this sees what
  real forward/backward costs (backward ~2x forward, unequal stages) do to each schedule.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.multirank is not installed
from tests.multirank import run_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
VIRTUAL = 2  # stages per rank for interleaved and ZB-V


def theory(schedule: str, p: int, m: int) -> float:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (VIRTUAL * m + p - 1)
    return 0.0


# ----- stage modules -----------------------------------------------------------------

class _Sleep(torch.autograd.Function):
    """Identity that takes `forward_s` in forward and `backward_s` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class TimedStage(nn.Module):
    """A stage whose passes take fixed times: forward f, input-gradient i, weight-gradient w (seconds).

    The weight enters through its own branch, so an input-gradient-only backward
    (zero bubble's I) does not run the weight's delay, and its weight pass (W) does.
    """

    def __init__(self, dim: int, f: float, i: float, w: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.f, self.i, self.w = f, i, w

    def forward(self, x):  # (mbs, T, dim) -> (mbs, T, dim)
        # The first stage's input (data) needs no gradient, but a real first stage still
        # back-propagates through its blocks to reach their weights: keep its delay in the graph.
        x = x if x.requires_grad else x.requires_grad_()
        return _Sleep.apply(x, self.f, self.i) + _Sleep.apply(self.weight, 0.0, self.w)


class RandomData:
    """What PipelineRunner reads a batch from: get_batch(indices) -> (inputs, targets)."""

    def __init__(self, make):
        self.make = make

    def get_batch(self, indices):
        return self.make(len(indices))


def build(args, p: int, schedule: str, m: int, device):
    """(runner, data, loss_fn) for one configuration, on this rank."""
    from polytrain.config import ModelConfig
    from polytrain.distributed.materialize import materialize
    from polytrain.distributed.pipeline import PipelineRunner, split_model
    from polytrain.distributed.pipeline.plan import plan_pipeline
    from polytrain.models import ARCHITECTURES
    from polytrain.train.loss import causal_lm_loss

    v = VIRTUAL if schedule in ("interleaved", "zero_bubble") else 1
    rank = dist.get_rank()
    if args.mode == "timed":
        mbs, seq, dim = 1, 8, 8
        plan = plan_pipeline(p, schedule, VIRTUAL, "", p * v, 0, m)
        t = args.op_ms / 1000 / v  # the same work per rank whatever the number of stages
        stages = nn.ModuleDict({str(s): TimedStage(dim, t, t, t) for s in plan.stages_of_rank(rank)})
        data = RandomData(lambda n: (torch.randn(n, seq, dim), torch.randn(n, seq, dim)))
        loss_fn = lambda y, target: (y * target).mean()  # noqa: E731
    else:
        mbs, seq = args.micro_batch, args.seq_len
        cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=4, ffn_dim=4 * args.dim,
                          vocab_size=args.vocab, max_seq_len=seq)
        dim = cfg.dim
        plan = plan_pipeline(p, schedule, VIRTUAL, "", cfg.n_layers, 0, m)
        with torch.device("meta"):
            model = ARCHITECTURES["llama"].build(cfg)
        stages = split_model(model, plan, rank)
        for stage in stages.values():
            materialize(stage, device, seed=0)
        data = RandomData(lambda n: (torch.randint(0, cfg.vocab_size, (n, seq)),
                                     torch.randint(0, cfg.vocab_size, (n, seq))))
        loss_fn = causal_lm_loss
    runner = PipelineRunner(plan, stages, rank, dist.group.WORLD, device, mbs, seq,
                            hidden_shape=(mbs, seq, dim), logits_shape=(mbs, seq, args.vocab))
    return runner, data, loss_fn


# ----- instrumentation ---------------------------------------------------------------

def instrument(runner, records: list):
    """Time every compute call of this rank's stages: records (kind, stage, micro-batch, start, end)."""
    def wrap(stage, name, kind_of):
        inner = getattr(stage, name)

        def timed(chunk_id, *a, **k):
            start = time.perf_counter()
            out = inner(chunk_id, *a, **k)
            records.append((kind_of(k), stage.stage_index, chunk_id, start, time.perf_counter()))
            return out
        setattr(stage, name, timed)

    for stage in runner.stages:
        wrap(stage, "forward_one_chunk", lambda k: "F")
        wrap(stage, "backward_one_chunk", lambda k: "B" if k.get("full_backward", True) else "I")
        wrap(stage, "backward_weight_one_chunk", lambda k: "W")


def simulate(actions: dict[int, list[tuple[str, int, int, float]]], num_stages: int) -> dict[int, float]:
    """Idle fraction per rank if each rank ran its operations in order with instant communication.

    actions: rank -> [(kind, stage, micro-batch, duration)] in the order the rank ran them.
    """
    done: dict[tuple, float] = {}
    free = {r: 0.0 for r in actions}
    pos = {r: 0 for r in actions}
    busy = {r: sum(a[3] for a in ops) for r, ops in actions.items()}

    def ready(kind, stage, mb):
        if kind == "F":
            return 0.0 if stage == 0 else done.get(("F", stage - 1, mb))
        if kind in ("B", "I"):
            if stage == num_stages - 1:
                return done.get(("F", stage, mb))
            return done.get(("grad", stage + 1, mb))
        return done.get(("grad", stage, mb))  # W after its I

    progress = True
    while progress:
        progress = False
        for r, ops in actions.items():
            while pos[r] < len(ops):
                kind, stage, mb, duration = ops[pos[r]]
                dep = ready(kind, stage, mb)
                if dep is None:
                    break
                end = max(free[r], dep) + duration
                free[r] = end
                done[(kind, stage, mb)] = end
                if kind in ("B", "I"):
                    done[("grad", stage, mb)] = end
                pos[r] += 1
                progress = True
    if any(pos[r] < len(ops) for r, ops in actions.items()):
        raise RuntimeError("recorded operations form no valid pipeline order")
    makespan = max(free.values())
    return {r: 1 - busy[r] / makespan for r in actions}


# ----- one world size ------------------------------------------------------------------

def _rank_body(rank: int, world: int, args) -> list[dict]:
    device = torch.device("cpu")
    results = []
    for schedule in args.schedules:
        for m in args.microbatches:
            runner, data, loss_fn = build(args, world, schedule, m, device)
            records: list = []
            losses: list = []

            def timed_loss(y, target):
                start = time.perf_counter()
                loss = loss_fn(y, target)
                losses.append((start, time.perf_counter()))
                return loss

            instrument(runner, records)
            batches = [[i] * (1 if args.mode == "timed" else args.micro_batch) for i in range(m)]
            idle, sim = defaultdict(list), defaultdict(list)
            for step in range(args.warmup + args.steps):
                records.clear()
                losses.clear()
                dist.barrier()
                start = time.perf_counter()
                runner.train_step(batches, data, timed_loss)
                dist.barrier()
                wall = time.perf_counter() - start
                for module in runner.modules.values():
                    module.zero_grad(set_to_none=True)
                if step < args.warmup:
                    continue
                busy = sum(e - s for *_, s, e in records) + sum(e - s for s, e in losses)
                mine = [(k, st, mb, e - s) for k, st, mb, s, e in records]
                loss_time = sum(e - s for s, e in losses) / max(1, len(losses))
                # The loss runs right after the last stage's forward: count it there.
                mine = [(k, st, mb, d + (loss_time if k == "F" and st == runner.plan.num_stages - 1 else 0.0))
                        for k, st, mb, d in mine]
                everyone: list = [None] * world
                dist.all_gather_object(everyone, (1 - busy / wall, mine))
                for r, (idle_r, _) in enumerate(everyone):
                    idle[r].append(idle_r)
                for r, value in simulate({r: ops for r, (_, ops) in enumerate(everyone)},
                                         runner.plan.num_stages).items():
                    sim[r].append(value)
            results.append({"schedule": schedule, "p": world, "m": m, "theory": theory(schedule, world, m),
                            "schedule_idle": [sum(v) / len(v) for _, v in sorted(sim.items())],
                            "measured_idle": [sum(v) / len(v) for _, v in sorted(idle.items())],
                            "step_s": wall})
            if rank == 0:
                r = results[-1]
                print(f"{args.mode} p={world} m={m} {schedule:12s} theory {r['theory']:.3f} | schedule "
                      + " ".join(f"{x:.3f}" for x in r["schedule_idle"]) + " | measured "
                      + " ".join(f"{x:.3f}" for x in r["measured_idle"]), flush=True)
    return results


def table(results: list[dict]) -> str:
    lines = ["| mode | p | m | schedule | theory | schedule order (per rank) | measured (per rank) | measured mean / theory |",
             "| --- | ---: | ---: | --- | ---: | --- | --- | ---: |"]
    for r in results:
        mean = sum(r["measured_idle"]) / len(r["measured_idle"])
        ratio = f"{mean / r['theory']:.2f}" if r["theory"] else "n/a"
        lines.append(f"| {r['mode']} | {r['p']} | {r['m']} | {r['schedule']} | {r['theory']:.3f} | "
                     + " / ".join(f"{x:.3f}" for x in r["schedule_idle"]) + " | "
                     + " / ".join(f"{x:.3f}" for x in r["measured_idle"]) + f" | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("both", "timed", "compute"), default="both")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--microbatches", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--pp", nargs="+", type=int, default=[2, 4], help="pipeline degrees for the timed mode")
    ap.add_argument("--op-ms", type=float, default=30.0, help="timed mode: ms of each pass per micro-batch per rank")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a short check that it runs; figures mean little")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.microbatches, args.pp, args.steps, args.op_ms, args.layers = [4], [2], 1, 5.0, 4
    load = os.getloadavg()[0]
    print(f"{datetime.date.today()} | cpu {os.cpu_count()} cores | torch {torch.__version__} | "
          f"load average {load:.1f} at start", flush=True)
    if load > 0.5:
        print("warning: the machine is busy; compute-mode figures will include waiting for a core", flush=True)
    results = []
    modes = ("timed", "compute") if args.mode == "both" else (args.mode,)
    for mode in modes:
        args.mode = mode
        for p in (args.pp if mode == "timed" else [2]):
            for r in run_ranks(p, _rank_body, args, timeout=3600)[0]:
                results.append({"mode": mode, **r})
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""polytrain's trainer against a plain hand-written PyTorch loop, side by side in one run.

    python benchmarks/trainer_vs_plain.py                   # the real measurement (~4 min, 2 cores)
    python benchmarks/trainer_vs_plain.py --rounds 2 --steps 3 --warmup 1 \\
        --dp-steps 8 --dp-log-every 2                       # a quick check that it runs
    python benchmarks/trainer_vs_plain.py --size small --precision bf16 --json results.json

1. Single process: tokens/s of `Trainer.train_step()` and of a ~25-line PyTorch loop training
   the same model (same weights, micro-batch, accumulation, fused AdamW, clipping, precision,
   data file), in alternating rounds so drift in machine speed hits both, twice: both with
   the chunked loss (the loop calls polytrain's `linear_cross_entropy` on the model's hidden
   states) and both with logits -> F.cross_entropy (`--loss` picks one). Target: ratio >= 1.0.
2. Data parallel (`--dp 2`; `--dp 0` skips): tokens/s of `polytrain train --parallel.nproc 2`
   against `--parallel.nproc 1` at the same global batch, read from each run's metrics.jsonl.
3. A markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from polytrain.backend import get_accelerator
from polytrain.config import Config, load_config
from polytrain.data import TokenDataset, prepare_corpus
from polytrain.models import ARCHITECTURES
from polytrain.models.common.init import init_plain
from polytrain.train.chunked_loss import linear_cross_entropy
from polytrain.train.metrics import read_metrics
from polytrain.train.trainer import Trainer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", help="model size preset (tiny, small, 125m, ...)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--source", default="stdlib",
                   help="data.source (the first stdlib call tokenizes, ~30 s, then it is cached)")
    p.add_argument("--rounds", type=int, default=5, help="alternating measured rounds per loop")
    p.add_argument("--steps", type=int, default=10, help="measured optimizer steps per round")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed optimizer steps per loop before the first round")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads of the single-process part and of the nproc 1 run")
    p.add_argument("--dp", type=int, default=2,
                   help="workers of the data-parallel run (0 = skip part 2)")
    p.add_argument("--dp-steps", type=int, default=36,
                   help="optimizer steps of each data-parallel run")
    p.add_argument("--dp-log-every", type=int, default=4,
                   help="steps per metrics row in the data-parallel runs")
    p.add_argument("--loss", default="chunked,plain",
                   help="loss algorithms to pair (chunked: output projection + loss in token chunks "
                        "on both sides; plain: logits -> F.cross_entropy on both sides)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return p.parse_args()


def config_overrides(args: argparse.Namespace) -> list[str]:
    """What both parts share: model, data, batch and precision."""
    return ["--model.size", args.size, "--data.source", args.source,
            "--data.seq_len", str(args.seq_len),
            "--train.micro_batch_size", str(args.micro_batch),
            "--train.global_batch_size", str(args.global_batch),
            "--train.precision", args.precision,
            "--train.attention_fp32", "false"]  # the plain loop runs its bf16 attention core in bf16


# ----- part 1: one process -------------------------------------------------------------


def plain_loop(cfg: Config, device: torch.device, chunked: bool):
    """The loop a competent user writes by hand, no framework: returns (its parameters, step).

    chunked: the model stops at the final norm and polytrain's linear_cross_entropy makes the
    loss from the hidden states and the output weight, as the trainer's loss head does.
    """
    t = cfg.train
    model = ARCHITECTURES["llama"].build(cfg.model)
    init_plain(model, cfg.run.seed)
    model.to(device).train()
    params = list(model.parameters())
    head = model.output
    if chunked:
        model.output = torch.nn.Identity()  # hidden states out; `head` keeps the weight
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=True)
    corpus = prepare_corpus(cfg.data, cfg.model.vocab_size)
    data = TokenDataset(corpus.train_path, corpus.dtype, cfg.data.seq_len)
    accum = t.global_batch_size // t.micro_batch_size
    rng = random.Random(cfg.run.seed)

    def step() -> None:
        for _ in range(accum):
            inputs, targets = data.get_batch(rng.sample(range(len(data)), t.micro_batch_size))
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16"):
                out = model(inputs)
                if chunked:
                    loss = linear_cross_entropy(out, head.weight, None, targets) / accum
            if not chunked:
                loss = F.cross_entropy(out.float().flatten(0, 1), targets.flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # No loss.item(): the baseline never waits on the device, so any per-step host
        # sync polytrain does (it reads loss and grad norm every step) counts against it.

    return params, step


def timed(step, n: int) -> float:
    """Seconds for n steps; synchronized so queued device work is counted."""
    acc = get_accelerator()
    acc.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    acc.synchronize()
    return time.perf_counter() - start


def single_process(args: argparse.Namespace, work: Path, loss: str) -> dict:
    total_steps = args.warmup + args.rounds * args.steps  # the trainer's lr schedule spans this
    cfg = load_config(None, config_overrides(args) + [
        "--run.out_dir", str(work / f"single-{loss}"), "--run.steps", str(total_steps),
        "--checkpoint.resume", "none", "--train.chunked_loss", str(loss == "chunked").lower()])
    trainer = Trainer(cfg)
    plain_params, plain_step = plain_loop(cfg, trainer.device, chunked=loss == "chunked")
    # The same model means the same starting weights, not just the same shapes.
    pairs = zip(trainer.model.parameters(), plain_params, strict=True)
    if not all(torch.equal(a, b) for a, b in pairs):
        raise SystemExit("error: the plain model's initial weights differ from the trainer's")
    print(trainer.describe(), flush=True)

    loops = {"polytrain": trainer.train_step, "plain": plain_step}
    for step in loops.values():
        timed(step, args.warmup)
    tokens = args.steps * cfg.train.global_batch_size * cfg.data.seq_len
    per_round: dict[str, list[float]] = {name: [] for name in loops}
    for r in range(args.rounds):
        # Swap who goes first each round, so neither always runs right after the other.
        for name in (("polytrain", "plain") if r % 2 == 0 else ("plain", "polytrain")):
            per_round[name].append(tokens / timed(loops[name], args.steps))
        print(f"round {r + 1}/{args.rounds} ({loss} loss): polytrain {per_round['polytrain'][-1]:,.0f} tok/s, "
              f"plain {per_round['plain'][-1]:,.0f} tok/s", flush=True)
    trainer.close()
    medians = {name: statistics.median(v) for name, v in per_round.items()}
    ratios = sorted(a / b for a, b in zip(per_round["polytrain"], per_round["plain"]))
    return {"params": trainer.model.num_params(), "per_round": per_round, "median": medians,
            "ratio": medians["polytrain"] / medians["plain"], "round_ratios": ratios}


# ----- part 2: data parallel -----------------------------------------------------------


def dp_run(args: argparse.Namespace, nproc: int, threads: int, work: Path) -> dict:
    """Run `polytrain train --parallel.nproc N` as a subprocess; median tokens/s of its rows."""
    out = work / f"nproc{nproc}"
    cmd = [sys.executable, "-m", "polytrain.cli", "train", *config_overrides(args),
           "--parallel.nproc", str(nproc), "--run.out_dir", str(out),
           "--run.steps", str(args.dp_steps), "--run.log_every", str(args.dp_log_every),
           "--run.eval_every", "0", "--run.sample_tokens", "0",
           "--checkpoint.every", "0", "--checkpoint.resume", "none"]
    # Set explicitly: the launcher would otherwise split all cores, and nproc 1 runs unlaunched.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    print(f"polytrain train --parallel.nproc {nproc} ({threads} thread(s) per worker) ...",
          flush=True)
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"error: the nproc {nproc} run failed (exit {done.returncode})")
    rates = [row["tokens_per_s"] for row in read_metrics(out) if "tokens_per_s" in row]
    # The first row also times start-up and the step-0 validation pass.
    if len(rates) < 2:
        raise SystemExit("error: need 2 or more logged rows; raise --dp-steps or lower --dp-log-every")
    return {"nproc": nproc, "threads_per_worker": threads, "rows": rates[1:],
            "median": statistics.median(rates[1:])}


def data_parallel(args: argparse.Namespace, work: Path) -> dict | None:
    acc = get_accelerator()
    if acc.name != "cpu" and acc.device_count() < args.dp:
        print(f"skipping data parallel: {args.dp} workers need {args.dp} devices, "
              f"{acc.device_count()} visible", flush=True)
        return None
    one = dp_run(args, 1, args.threads, work)
    many = dp_run(args, args.dp, max(1, args.threads // args.dp), work)
    return {"nproc1": one, f"nproc{args.dp}": many, "scaling": many["median"] / one["median"]}


# ----- report --------------------------------------------------------------------------


def scaling_note(args: argparse.Namespace) -> str:
    if get_accelerator().name != "cpu":
        return f"ideal {args.dp}.0"
    return (f"on this CPU {args.dp} workers with {max(1, args.threads // args.dp)} thread(s) "
            f"each share the {args.threads} threads one worker uses, so ~1.0 is the ceiling; "
            f"on {args.dp} GPUs the ideal is {args.dp}.0")


def spread(values: list[float]) -> str:
    return f"{min(values):,.0f}-{max(values):,.0f}"


def report(args: argparse.Namespace, singles: dict[str, dict], dp: dict | None, load: float | None) -> str:
    acc = get_accelerator()
    load_text = f" | load average at start {load:.1f}" if load is not None else ""
    command = " ".join(["python benchmarks/trainer_vs_plain.py", *sys.argv[1:]])
    params = next(iter(singles.values()))["params"]
    lines = [
        f"Machine: {acc.describe()} | {datetime.date.today().isoformat()}{load_text}",
        (f"Model: llama {args.size} ({params / 1e6:.1f}M parameters), "
         f"seq {args.seq_len}, micro-batch {args.micro_batch}, global batch {args.global_batch}, "
         f"{args.precision}, {args.rounds} rounds x {args.steps} steps after {args.warmup} warmup"),
        f"Command: `{command}`",
        "",
        "| measurement | loss | tokens/s (median) | spread over rounds | ratio (per-round ratios) |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for loss, single in singles.items():
        rounds = " ".join(f"{r:.3f}" for r in single["round_ratios"])
        lines += [
            f"| plain PyTorch loop, 1 process | {loss} | {single['median']['plain']:,.0f} "
            f"| {spread(single['per_round']['plain'])} | |",
            (f"| polytrain `Trainer.train_step()`, 1 process | {loss} | {single['median']['polytrain']:,.0f} "
             f"| {spread(single['per_round']['polytrain'])} | **{single['ratio']:.3f}** of plain ({rounds}) |"),
        ]
    if dp is not None:
        one, many = dp["nproc1"]["median"], dp[f"nproc{args.dp}"]["median"]
        lines += [
            f"| `polytrain train --parallel.nproc 1` | chunked | {one:,.0f} | | |",
            (f"| `polytrain train --parallel.nproc {args.dp}` | chunked | {many:,.0f} | "
             f"| {dp['scaling']:.2f}x of nproc 1 ({scaling_note(args)}) |"),
        ]
    return "\n".join(lines)


def load_average() -> float | None:
    """1-minute load average at the start (Unix only): other jobs make every figure noisy."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def main() -> None:
    args = parse_args()
    load = load_average()
    if load is not None and load > 0.5:
        print(f"warning: load average {load:.1f} before starting; other jobs are running, so "
              "the figures will be noisy (2-thread runs suffer most)", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows one-time tokenizing
    torch.set_num_threads(args.threads)  # one process, so both loops share these threads
    with tempfile.TemporaryDirectory(prefix="polytrain-bench-") as tmp:
        singles = {loss: single_process(args, Path(tmp), loss) for loss in args.loss.split(",")}
        dp = data_parallel(args, Path(tmp)) if args.dp > 0 else None
    table = report(args, singles, dp, load)
    print("\n" + table)
    if args.json:
        record = {"machine": get_accelerator().describe(), "torch": torch.__version__,
                  "date": datetime.date.today().isoformat(), "load_average": load,
                  "args": vars(args), "single_process": singles, "data_parallel": dp,
                  "table": table}
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")  # default: Path
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

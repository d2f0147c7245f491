"""Two `Trainer`s of one config but one setting, timed in alternating rounds on the same ranks.

Shared by compile_speed.py (train.compile), tp_overlap.py (parallel.tp_overlap) and fp32_gemm.py
(train.fp32_gemm; the last two through `train_pair`): each
round runs `steps` timed train_step()s of one trainer, then of the other, between barriers,
who goes first swapping each round, so drift in machine speed hits both alike.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from pathlib import Path


def alternate(trainers: dict, rounds: int, steps: int, tokens_per_step: int) -> tuple[dict, dict]:
    """({name: tokens/s per round}, {name: loss after its last step}); `trainers` holds two."""
    import torch.distributed as dist

    first, second = trainers
    rates: dict[str, list[float]] = {name: [] for name in trainers}
    losses: dict[str, float] = {}
    for r in range(rounds):
        for name in ((first, second) if r % 2 == 0 else (second, first)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                losses[name] = trainers[name].train_step()["loss"]
            dist.barrier()
            rates[name].append(tokens_per_step * steps / (time.perf_counter() - start))
    return rates, losses


def train_pair(args, world: int, layout: list[str], work: Path, settings: dict[str, list[str]],
               tokens_per_step: int, global_batch: int) -> dict:
    """Two `Trainer`s of args.arch / args.size at args.seq_len x args.micro_batch on `layout`, each with
    its `settings[name]` overrides, warmed up, then timed by `alternate`: {"rates", "losses"}."""
    import torch

    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    torch.set_num_threads(max(1, args.threads // world))
    trainers = {}
    for name, setting in settings.items():
        overrides = ["--model.arch", args.arch, "--model.size", args.size, "--data.source", args.source,
                     "--data.seq_len", str(args.seq_len), "--model.max_seq_len", str(args.seq_len),
                     "--train.micro_batch_size", str(args.micro_batch), "--train.global_batch_size", str(global_batch),
                     "--run.steps", str(args.warmup + args.rounds * args.steps), "--run.out_dir", str(work / name),
                     "--run.eval_every", "0", "--run.sample_tokens", "0", "--checkpoint.resume", "none",
                     *layout, *setting]
        trainers[name] = Trainer(load_config(None, overrides))
        for _ in range(args.warmup):
            trainers[name].train_step()
    rates, losses = alternate(trainers, args.rounds, args.steps, tokens_per_step)
    for trainer in trainers.values():
        trainer.close()
    return {"rates": rates, "losses": losses}


def run_layouts(args, layouts: dict[str, list[str]], body, old: str, new: str) -> tuple[list[dict], float]:
    """For each of args.layouts (a comma list of `layouts`' names): `body` on 2 gloo ranks
    (tests/multirank.py), which returns train_pair's {"rates", "losses"}, compared new / old;
    (the rows, the load average at the start)."""
    import tempfile

    from tests.multirank import run_ranks  # the caller put the repository root on sys.path

    load = load_at_start()
    rows = []
    with tempfile.TemporaryDirectory(prefix="polytrain-paired-") as tmp:
        for layout in args.layouts.split(","):
            result = run_ranks(2, body, args, layouts[layout], str(Path(tmp) / f"layout{len(rows)}"), timeout=3600)[0]
            row = {"layout": layout, **result, **compare(result["rates"], new, old)}
            rows.append(row)
            print(progress_line(layout, row, old, new), flush=True)
    return rows, load


def publish_pairs(args, rows: list[dict], load: float, old: str, new: str, labels: tuple[str, str]) -> None:
    """run_layouts' rows under the run's line (the command, shape and rounds), printed and, with
    --json, written (`publish`); `labels` name the old and new trainers in the table's header."""
    import sys

    run = (f"`python {' '.join(sys.argv)}`: {args.arch} {args.size}, seq {args.seq_len} x micro-batch "
           f"{args.micro_batch} a rank, fp32, {args.rounds} rounds x {args.steps} steps after {args.warmup} "
           f"warm-up, {args.threads} threads over the 2 ranks")
    publish("\n".join([machine_line(load), run, "", *pair_table(rows, old, new, *labels)]), args.json, args, rows)


def pair_table(rows: list[dict], old: str, new: str, old_label: str, new_label: str) -> list[str]:
    """run_layouts' rows as a table: tokens/s each way, the ratio new / old, the rounds, the last losses."""
    lines = [f"| layout | {old_label} tok/s (spread) | {new_label} tok/s (spread) | {new}/{old} | per-round ratios "
             f"| loss {old} / {new} |",
             "| --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['layout']} | {spread(r['rates'][old])} | {spread(r['rates'][new])} "
                     f"| **{r['ratio']:.3f}** | {ratios(r['round_ratios'])} "
                     f"| {r['losses'][old]:.5f} / {r['losses'][new]:.5f} |")
    return lines


def compare(rates: dict[str, list[float]], new: str, old: str) -> dict:
    """Medians, the ratio of medians new / old and the sorted per-round ratios."""
    median = {name: statistics.median(v) for name, v in rates.items()}
    return {"median": median, "ratio": median[new] / median[old],
            "round_ratios": sorted(a / b for a, b in zip(rates[new], rates[old]))}


def spread(values: list[float]) -> str:
    """'median (min-max)' in tokens/s."""
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def ratios(values: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in values)


def add_layout_arguments(p, layouts: dict[str, list[str]]) -> None:
    """train_pair's model and shape arguments (gpt2 small, seq 256 x micro-batch 8: vs_megatron's) and
    --layouts, a comma list of `layouts`' names (all by default)."""
    p.add_argument("--arch", default="gpt2")
    p.add_argument("--size", default="small")
    p.add_argument("--layouts", default=",".join(layouts), help="comma list of " + ", ".join(layouts))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)


def add_round_arguments(p, rounds: int) -> None:
    """The arguments every paired benchmark takes: data source, rounds, steps, warm-up, threads, --json."""
    import os

    p.add_argument("--source", default="stdlib", help="data.source (the first stdlib call tokenizes, ~30 s)")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per trainer and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per trainer first (a compiled one compiles)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads shared by the job's ranks")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")


def load_at_start() -> float:
    """The load average now, with a warning when something else is running."""
    import os

    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f} before starting; the figures will be noisy", flush=True)
    return load


def progress_line(label: str, row: dict, old: str, new: str, extra: str = "", digits: int = 5) -> str:
    """A row's figures as they arrive: both trainers' tokens/s, the ratio new / old, the rounds, the losses."""
    rates, losses = row["rates"], row["losses"]
    return (f"{label}: {old} {spread(rates[old])} tok/s, {new} {spread(rates[new])} tok/s ({row['ratio']:.3f}x; "
            f"rounds {ratios(row['round_ratios'])}){extra}, losses {losses[old]:.{digits}f} / {losses[new]:.{digits}f}")


def machine_line(load: float) -> str:
    """The date, the device and the load average the run started at: a RESULTS block's first line."""
    from polytrain.backend import get_accelerator

    return f"{datetime.date.today()}, {get_accelerator().describe()}, load average at start {load:.1f}"


def publish(table: str, json_path: Path | None, args, rows: list[dict]) -> None:
    """Print the table; with --json, write it with every figure and the arguments."""
    print("\n" + table)
    if json_path:
        json_path.write_text(json.dumps({"args": vars(args), "rows": rows, "table": table}, indent=1, default=str))

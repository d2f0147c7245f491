"""Two `Trainer`s of one config but one setting, timed in alternating rounds on the same ranks.

Shared by compile_speed.py (train.compile) and tp_overlap.py (parallel.tp_overlap): each
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

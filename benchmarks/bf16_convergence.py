"""bf16 model states against fp32 on the default run: the losses over 200 steps.

    python benchmarks/bf16_convergence.py                 # two default runs, ~10 min on a quiet 2-core CPU
    python benchmarks/bf16_convergence.py --steps 20      # a quick check that it runs

Runs `polytrain train` (the default run: llama tiny on the stdlib corpus, 16 x 256 tokens
per step) with --train.precision fp32 and then bf16 (16-bit weights and gradients, fp32
masters and Adam moments), same seed and data, and compares: the validation loss at the
end, the mean training loss over the last 10% of the steps, and the largest relative gap
of the training loss (smoothed over 10-step windows) anywhere after the warmup.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    return p.parse_args()


def run(precision: str, steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "polytrain.cli", "train", "--train.precision", precision,
           "--run.steps", str(steps), "--run.out_dir", str(out), "--checkpoint.resume", "none",
           "--run.sample_tokens", "0", "--run.log_every", "1"]  # every step's loss: the gaps below index steps
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def smooth(values: list[float], window: int = 10) -> list[float]:
    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]


def main() -> None:
    args = parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="polytrain-bf16-") as work:
        for precision in ("fp32", "bf16"):
            print(f"{precision}: {args.steps} steps ...", flush=True)
            rows[precision] = run(precision, args.steps, Path(work) / precision)
    train = {p: [r["loss"] for r in rs if "loss" in r] for p, rs in rows.items()}
    val = {p: [r["val_loss"] for r in rs if "val_loss" in r][-1] for p, rs in rows.items()}
    tail = max(1, args.steps // 10)
    last = {p: sum(v[-tail:]) / tail for p, v in train.items()}
    warm = 20  # the default warmup
    gaps = [abs(b - a) / a for a, b in zip(smooth(train["fp32"][warm:]), smooth(train["bf16"][warm:]))]
    from polytrain.backend import get_accelerator

    lines = [
        f"Machine: {get_accelerator().describe()} | {datetime.date.today().isoformat()} | "
        f"load average {os.getloadavg()[0]:.1f}",
        f"Command: `python benchmarks/bf16_convergence.py {' '.join(sys.argv[1:])}` (the default run, {args.steps} steps)",
        "",
        "| | fp32 | bf16 | bf16 / fp32 - 1 |",
        "| --- | ---: | ---: | ---: |",
        f"| validation loss at step {args.steps} | {val['fp32']:.4f} | {val['bf16']:.4f} | "
        f"{val['bf16'] / val['fp32'] - 1:+.2%} |",
        f"| mean training loss, last {tail} steps | {last['fp32']:.4f} | {last['bf16']:.4f} | "
        f"{last['bf16'] / last['fp32'] - 1:+.2%} |",
        f"| largest gap of the 10-step mean training loss after step {warm} | | | {max(gaps):.2%} |",
    ]
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "table": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Train configs/passkey_long.toml's model on pass-key retrieval up to 8K tokens with context
parallelism, then run `polytrain eval needle` on it over lengths x depths up to 16K.

    python benchmarks/needle_passkey.py                 # the 6 stages and the evaluation, ~55 min on 2 cores
    python benchmarks/needle_passkey.py --out /tmp/needle --lengths 1k,2k,4k,8k,16k --repeats 4
    python benchmarks/needle_passkey.py --stages 1 --lengths 256 --repeats 1   # a check that it runs

A 2-block llama learns retrieval at short context first (where a tiny model learns it in
minutes) and the context then grows, each stage resuming from the last one's checkpoint
(the step count runs on; a resumed run may change seq_len, the batch and the layout):

    1. 256 tokens, one process, every token scored: the haystack's language modelling
       teaches the copying the task needs
    2. 1K tokens, ring cp 2, every token scored: positions past 256
    3. 1K tokens, ring cp 2, only the key's tokens scored (data.passkey_score = answer)
    4. 4K tokens, ring cp 4, answer scored
    5. 8K tokens, ring cp 4, answer scored
    6. the same at a learning rate of 3e-4 (the late 1e-3 steps left the scores noisy)

A stage trained only at length L retrieves a needle at most about L tokens back (measured:
RESULTS.md), so the grid's 16K column tells whether retrieval reaches past the trained
length. The evaluation reads the grid with --parallel.cp (sharded prefill and KV cache) and
writes needle.json / needle.png into OUT/passkey_8k_final.
Prints each stage's seconds and validation loss and the score grid as a RESULTS.md table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "passkey_long.toml"
# name, seq_len, ring cp, micro-batch, global batch, last step, scored targets, min_lr (the
# cosine schedule is recomputed over each stage's last step; a floor of 1e-3 keeps the late
# stages learning)
STAGES = [
    ("passkey_256", 256, 1, 16, 16, 1000, "all", "3e-4"),
    ("passkey_1k", 1024, 2, 8, 16, 1400, "all", "3e-4"),
    ("passkey_1k_answer", 1024, 2, 8, 16, 1700, "answer", "3e-4"),
    ("passkey_4k", 4096, 4, 4, 8, 1850, "answer", "1e-3"),
    ("passkey_8k", 8192, 4, 4, 8, 1950, "answer", "1e-3"),
    ("passkey_8k_final", 8192, 4, 4, 8, 2000, "answer", "3e-4"),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/needle_passkey"), help="run directories go here")
    p.add_argument("--stages", type=int, default=len(STAGES), help="train the first N stages")
    p.add_argument("--lengths", default="1k,2k,4k,8k,16k")
    p.add_argument("--depths", default="0,25,50,75,100")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--eval-cp", type=int, default=4, help="--parallel.cp of the evaluation")
    p.add_argument("--json", type=Path, help="also write the stages and the grid here")
    return p.parse_args()


def _polytrain(args: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "polytrain.cli", *args], check=True, env=env, cwd=cwd)
    return time.perf_counter() - start


def _last_val_loss(run: Path) -> float | None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    return losses[-1] if losses else None


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stages, previous = [], None
    for name, seq_len, cp, micro, batch, last_step, score, min_lr in STAGES[:args.stages]:
        run = args.out / name
        overrides = ["--config", str(CONFIG), "--run.out_dir", str(run), "--data.seq_len", str(seq_len),
                     "--parallel.nproc", str(cp), "--parallel.cp", str(cp), "--train.micro_batch_size", str(micro),
                     "--train.global_batch_size", str(batch), "--run.steps", str(last_step),
                     "--data.passkey_score", score, "--train.min_lr", min_lr, "--checkpoint.every", "50",
                     "--run.eval_every", "50",
                     "--checkpoint.resume", previous or "none"]
        seconds = _polytrain(["train", *overrides], args.out)
        previous = str(run / "checkpoints" / f"step_{last_step}")
        stages.append({"stage": name, "seq_len": seq_len, "cp": cp, "global_batch": batch, "last_step": last_step,
                       "score": score, "seconds": round(seconds), "val_loss": _last_val_loss(run)})
        print(f"stage {name}: {seconds:.0f} s, validation loss {stages[-1]['val_loss']}", flush=True)
    final = args.out / STAGES[args.stages - 1][0]
    seconds = _polytrain(["eval", "needle", str(final), "--lengths", args.lengths, "--depths", args.depths,
                          "--repeats", str(args.repeats), "--parallel.cp", str(args.eval_cp)], args.out)
    grid = json.loads((final / "needle.json").read_text())
    if args.json:
        args.json.write_text(json.dumps({"stages": stages, "grid": grid, "eval_seconds": seconds}, indent=1))
    _report(args, stages, grid, seconds, final)


def _report(args, stages: list[dict], grid: dict, eval_seconds: float, final: Path) -> None:
    print(f"\n{datetime.date.today()}, cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, gloo; load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| stage | tokens | ring cp | global batch | steps to | scored | seconds | validation loss |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for s in stages:
        loss = "" if s["val_loss"] is None else f"{s['val_loss']:.4f}"
        print(f"| {s['stage']} | {s['seq_len']:,} | {s['cp']} | {s['global_batch']} | {s['last_step']} | "
              f"{s['score']} | {s['seconds']:,} | {loss} |")
    print(f"\n`polytrain eval needle {final.name} --lengths {args.lengths} --depths {args.depths} --repeats "
          f"{args.repeats} --parallel.cp {args.eval_cp}` ({eval_seconds:.0f} s): score 0-100, "
          f"{grid['repeats']} prompts per cell\n")
    print("| depth % | " + " | ".join(f"{n:,}" for n in grid["lengths"]) + " |")
    print("| ---: | " + " | ".join("---:" for _ in grid["lengths"]) + " |")
    for j, depth in enumerate(grid["depths"]):
        print(f"| {depth:g} | " + " | ".join(f"{row[j]:.0f}" for row in grid["scores"]) + " |")
    print(f"\noverall {grid['overall']:.1f} / 100; heatmap {final / 'needle.png'}")


if __name__ == "__main__":
    main()

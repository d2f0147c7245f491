"""Large-batch study: AdamW with square-root learning-rate scaling against LAMB at batch B, 8B, 32B.

    nice -n 10 python benchmarks/large_batch.py            # 42 min on a loaded 2-core CPU, 1 thread
    python benchmarks/large_batch.py --tokens 40000 --batch 4   # ~2 min check that it runs

Every run trains the same small llama (dim 64, 2 layers, 4 heads, vocab 512, sequence 64:
~0.1M parameters) from the same initial weights on the same number of tokens, at global
batch B, 8B and 32B sequences; so 8B takes 1/8 of B's optimizer steps. The micro-batch
stays B (gradient accumulation makes up the rest), so each run does the same arithmetic.
Each optimizer's learning rate at batch B is the best of a few (`--adamw-lrs`, `--lamb-lrs`)
on a quarter of the tokens at batch B; larger batches scale it with the square root of the
batch (lr(kB) = lr(B) sqrt(k), the usual rule for Adam-type optimizers, used by the LAMB
paper too), with a linear warmup over 10% of the steps and a cosine decay to lr/10. Both
use weight decay 0.1 and clip the gradient norm at 1; eps is 1e-8 for AdamW (polytrain's
default) and 1e-6 for LAMB (the paper's). Each run's validation loss is measured on the same 256 held-out
sequences every 1/8 of its tokens. Prints one markdown table (final validation loss per
run) and draws benchmarks/large_batch.png: validation loss against tokens, and final loss
against batch size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from polytrain.config import load_config
from polytrain.errors import TrainingDiverged
from polytrain.train.metrics import read_metrics
from polytrain.train.trainer import Trainer

MODEL = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_dim": 128, "model.vocab_size": 512, "data.seq_len": 64}
MULTIPLES = (1, 8, 32)
VAL_SEQUENCES = 256
POINTS = 8  # validation measurements per run
EPS = {"adamw": 1e-8, "lamb": 1e-6}


def run_once(optimizer: str, lr: float, batch: int, micro: int, tokens: int, seq: int, out: Path) -> dict:
    """Train one configuration; return its validation curve [(tokens, loss)] and timing."""
    steps = max(1, tokens // (batch * seq))
    overrides = {**MODEL, "train.optimizer": optimizer, "train.lr": lr, "train.min_lr": lr / 10,
                 "train.eps": EPS[optimizer],
                 "train.warmup_steps": max(1, steps // 10), "train.weight_decay": 0.1,
                 "train.micro_batch_size": micro, "train.global_batch_size": batch,
                 "run.steps": steps, "run.eval_every": max(1, steps // POINTS),
                 "run.eval_batches": max(1, VAL_SEQUENCES // batch), "run.log_every": max(1, steps // POINTS),
                 "run.sample_tokens": 0, "run.seed": 1, "run.out_dir": str(out),
                 "checkpoint.every": 0, "checkpoint.resume": "none"}
    args = [x for key, value in overrides.items() for x in (f"--{key}", str(value))]
    start = time.perf_counter()
    try:
        Trainer(load_config(None, args)).train()
        diverged = False
    except TrainingDiverged:  # a learning rate too high for this batch: a result, not a crash
        diverged = True
    rows = read_metrics(out)
    curve = [(r["step"] * batch * seq, r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    return {"optimizer": optimizer, "batch": batch, "lr": lr, "steps": steps, "curve": curve,
            "final": math.inf if diverged else curve[-1][1], "seconds": time.perf_counter() - start}


def plot(results: list[dict], base: int, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    curves, finals = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colors = {"adamw": "tab:blue", "lamb": "tab:red"}
    styles = {1: ":", 8: "--", 32: "-"}
    for r in results:
        if len(r["curve"]) < 2:
            continue
        tokens, losses = zip(*r["curve"][1:])  # from the first measurement after step 0
        label = f"{r['optimizer']} {r['batch'] // base}B (lr {r['lr']:.3g})"
        curves.plot(tokens, losses, styles.get(r["batch"] // base, "-"), color=colors[r["optimizer"]], label=label)
    curves.set(xlabel="training tokens", ylabel="validation loss", title="validation loss during training")
    curves.legend(fontsize=8)
    for name, color in colors.items():
        mine = [r for r in results if r["optimizer"] == name]
        finals.plot([r["batch"] for r in mine], [r["final"] for r in mine], "o-", color=color, label=name)
    finals.set_xscale("log", base=2)
    finals.set(xlabel="global batch (sequences)", ylabel="final validation loss",
               title="same tokens, growing batch")
    finals.legend()
    for ax in (curves, finals):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


def table(results: list[dict], base: int) -> str:
    lines = ["| optimizer | batch (sequences) | lr | steps | final val loss | time (s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['optimizer']} | {r['batch']} ({r['batch'] // base}B) | {r['lr']:.3g} | "
                     f"{r['steps']} | {r['final']:.4f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="B: the smallest global batch, in sequences")
    parser.add_argument("--tokens", type=int, default=2**20, help="training tokens per run")
    parser.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2", help="AdamW learning rates tried at batch B")
    parser.add_argument("--lamb-lrs", default="1e-2,3e-2,1e-1", help="LAMB learning rates tried at batch B")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", type=Path, default=Path(__file__).parent / "large_batch.png")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("POLYTRAIN_ACCELERATOR", "cpu")
    seq = MODEL["data.seq_len"]
    results, sweep, base_lr = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, lrs in (("adamw", args.adamw_lrs), ("lamb", args.lamb_lrs)):
            tried = []
            for lr in map(float, lrs.split(",")):
                tried.append(run_once(optimizer, lr, args.batch, args.batch, args.tokens // 4, seq,
                                      Path(tmp) / f"sweep_{optimizer}_{lr}"))
                print(f"{optimizer} lr {lr:g} at batch {args.batch}, {args.tokens // 4} tokens: "
                      f"final val loss {tried[-1]['final']:.4f}", flush=True)
            base_lr[optimizer] = min(tried, key=lambda r: r["final"])["lr"]
            sweep += tried
        for k in MULTIPLES:
            for optimizer in ("adamw", "lamb"):
                lr = base_lr[optimizer] * math.sqrt(k)  # square-root scaling with the batch
                r = run_once(optimizer, lr, args.batch * k, args.batch, args.tokens, seq,
                             Path(tmp) / f"{optimizer}_{k}")
                print(f"{optimizer} batch {r['batch']}: final val loss {r['final']:.4f} "
                      f"({r['steps']} steps, {r['seconds']:.0f} s)", flush=True)
                results.append(r)
    plot(results, args.batch, args.plot)
    print(f"\n{datetime.date.today()}, {args.tokens} tokens per run, plot: {args.plot}\n")
    print(table(results, args.batch))
    print(f"\nlearning-rate choice at batch {args.batch}, {args.tokens // 4} tokens:\n")
    print(table(sweep, args.batch))
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "sweep": sweep}, indent=1))


if __name__ == "__main__":
    main()

"""Large-batch study: how far can the batch grow at equal tokens before validation loss suffers, AdamW vs LAMB.

    nice -n 10 python benchmarks/large_batch.py                 # the full study: hours on a quiet 2-core CPU
    python benchmarks/large_batch.py --reduced                  # ~30-60 min: fewer multiples, one seed, 100 steps
    python benchmarks/large_batch.py --rampup --json lb.json    # with a batch-size ramp-up at every multiple

Colossal-AI reports that LAMB and LARS keep accuracy while the batch grows from 512 to 65536.
Scaled to this machine: a small llama (dim 64, 2 layers, 4 heads, vocab 512, sequence 64,
~0.1M parameters) trained from the same initial weights on the same token budget at global
batch k x B for k in `--multiples`, for AdamW and LAMB, over `--seeds` seeds. The budget is
chosen so that the largest batch still takes `--min-steps` optimizer steps (300 by default:
too few steps, not the batch, is what sank the large batches of the earlier study), so the
base batch takes k_max times as many.

- Learning rate: each optimizer's rate at batch B is the best of `--adamw-lrs` / `--lamb-lrs`
  on a quarter of the budget; batch kB scales it by sqrt(k) (the usual rule for Adam-type
  optimizers, which the LAMB paper uses too), times each of `--lr-factors` (the best kept).
- Schedule: linear warmup over `--warmup` of the steps, cosine decay to lr/10; weight decay
  0.1, gradient clipping at 1; eps 1e-8 (AdamW) and 1e-6 (LAMB, the paper's).
- `--rampup`: the batch ramps from B to kB by B over the first `--warmup` of the samples
  (train.batch_rampup_*), the step count fixed by the final batch.
- The micro-batch stays B (accumulation makes up the rest), so each run does the same
  arithmetic; validation is the same 256 held-out sequences, 8 times a run.

Result: per optimizer, the final validation loss (mean and spread over seeds) at each
multiple, and the largest multiple whose mean stays within 2% of the base batch's; one
markdown table, and benchmarks/large_batch.png (validation loss against tokens for the
first seed; final loss against batch with the 2% band).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
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
VAL_SEQUENCES = 256
POINTS = 8  # validation measurements per run
EPS = {"adamw": 1e-8, "lamb": 1e-6}
TOLERANCE = 0.02  # "within 2% of the base batch's validation loss"


def run_once(optimizer: str, lr: float, batch: int, micro: int, tokens: int, seed: int, warmup: float,
             rampup: bool, out: Path) -> dict:
    """Train one configuration; return its validation curve [(tokens, loss)], final loss and timing."""
    seq = MODEL["data.seq_len"]
    steps = max(1, tokens // (batch * seq))
    overrides = {**MODEL, "train.optimizer": optimizer, "train.lr": lr, "train.min_lr": lr / 10,
                 "train.eps": EPS[optimizer], "train.warmup_steps": max(1, int(steps * warmup)),
                 "train.weight_decay": 0.1, "train.micro_batch_size": micro, "train.global_batch_size": batch,
                 "run.steps": steps, "run.eval_every": max(1, steps // POINTS),
                 "run.eval_batches": max(1, VAL_SEQUENCES // batch), "run.log_every": max(1, steps // POINTS),
                 "run.sample_tokens": 0, "run.seed": seed, "run.out_dir": str(out),
                 "checkpoint.every": 0, "checkpoint.resume": "none"}
    if rampup and batch > micro:
        overrides.update({"train.batch_rampup_start": micro, "train.batch_rampup_increment": micro,
                          "train.batch_rampup_samples": max(1, int(steps * warmup) * batch)})
    args = [x for key, value in overrides.items() for x in (f"--{key}", str(value))]
    start = time.perf_counter()
    try:
        Trainer(load_config(None, args)).train()
        diverged = False
    except TrainingDiverged:  # a learning rate too high for this batch: a result, not a crash
        diverged = True
    rows = read_metrics(out)
    trained = [r for r in rows if "loss" in r]
    consumed = {r["step"]: r["tokens"] for r in trained}
    curve = [(consumed.get(r["step"], 0), r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    return {"optimizer": optimizer, "batch": batch, "lr": lr, "seed": seed, "steps": steps, "curve": curve,
            "final": math.inf if diverged else curve[-1][1], "seconds": time.perf_counter() - start}


def summarise(results: list[dict], base: int, multiples: list[int]) -> dict[str, dict]:
    """Per optimizer: mean and spread of the final loss at each multiple, and the largest within 2%."""
    out = {}
    for name in sorted({r["optimizer"] for r in results}):
        by_k = {}
        for k in multiples:
            finals = [r["final"] for r in results if r["optimizer"] == name and r["batch"] == k * base]
            if finals:
                by_k[k] = (statistics.fmean(finals), (max(finals) - min(finals)) / 2, len(finals))
        reference = by_k[multiples[0]][0]
        kept = [k for k in multiples if k in by_k and by_k[k][0] <= reference * (1 + TOLERANCE)]
        out[name] = {"by_multiple": by_k, "largest_within_2pct": max(kept) if kept else None}
    return out


def plot(results: list[dict], summary: dict, base: int, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    curves, finals = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colors = {"adamw": "tab:blue", "lamb": "tab:red"}
    first_seed = min(r["seed"] for r in results)
    multiples = sorted({r["batch"] // base for r in results})
    for r in results:
        if r["seed"] != first_seed or len(r["curve"]) < 2:
            continue
        tokens, losses = zip(*r["curve"][1:])  # from the first measurement after step 0
        shade = 0.35 + 0.65 * multiples.index(r["batch"] // base) / max(1, len(multiples) - 1)
        curves.plot(tokens, losses, color=colors[r["optimizer"]], alpha=shade,
                    label=f"{r['optimizer']} {r['batch'] // base}B")
    curves.set(xlabel="training tokens", ylabel="validation loss", title=f"validation loss (seed {first_seed})")
    curves.legend(fontsize=7, ncol=2)
    for name, color in colors.items():
        if name not in summary:
            continue
        ks = sorted(summary[name]["by_multiple"])
        means = [summary[name]["by_multiple"][k][0] for k in ks]
        spread = [summary[name]["by_multiple"][k][1] for k in ks]
        finals.errorbar([k * base for k in ks], means, yerr=spread, fmt="o-", color=color, capsize=3, label=name)
        finals.axhline(means[0] * (1 + TOLERANCE), color=color, linestyle=":", alpha=0.6)
    finals.set_xscale("log", base=2)
    finals.set(xlabel="global batch (sequences)", ylabel="final validation loss",
               title="equal tokens; dotted: base batch + 2%")
    finals.legend()
    for ax in (curves, finals):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


def table(summary: dict, base: int, results: list[dict]) -> str:
    lines = ["| optimizer | batch (sequences) | lr | steps | final val loss (mean +- half-range, seeds) |",
             "| --- | --- | --- | ---: | --- |"]
    for name, s in summary.items():
        for k, (mean, spread, n) in s["by_multiple"].items():
            run = next(r for r in results if r["optimizer"] == name and r["batch"] == k * base)
            lines.append(f"| {name} | {k * base} ({k}B) | {run['lr']:.3g} | {run['steps']} | "
                         f"{mean:.4f} +- {spread:.4f} ({n}) |")
    lines.append("")
    for name, s in summary.items():
        lines.append(f"- {name}: largest multiple within 2% of the base batch's loss: "
                     f"{s['largest_within_2pct']}B" if s["largest_within_2pct"] else f"- {name}: none")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4, help="B: the base global batch, in sequences")
    p.add_argument("--multiples", default="1,2,4,8,16,32", help="batch multiples k of B")
    p.add_argument("--min-steps", type=int, default=300, help="optimizer steps of the largest batch")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2", help="AdamW learning rates tried at batch B")
    p.add_argument("--lamb-lrs", default="1e-2,3e-2,1e-1", help="LAMB learning rates tried at batch B")
    p.add_argument("--lr-factors", default="0.5,1,2", help="factors on the sqrt-scaled lr tried at each multiple")
    p.add_argument("--warmup", type=float, default=0.05, help="share of the steps (and ramp-up samples)")
    p.add_argument("--rampup", action="store_true", help="ramp the batch from B up over the warmup")
    p.add_argument("--reduced", action="store_true",
                   help="a quick version: multiples 1,4,16, one seed, 100 steps, lr factor 1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", type=Path, default=Path(__file__).parent / "large_batch.png")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args()
    if args.reduced:
        args.multiples, args.seeds, args.min_steps, args.lr_factors = "1,4,16", "1", 100, "1"
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("POLYTRAIN_ACCELERATOR", "cpu")
    multiples = [int(k) for k in args.multiples.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    factors = [float(f) for f in args.lr_factors.split(",")]
    seq = MODEL["data.seq_len"]
    tokens = args.min_steps * max(multiples) * args.batch * seq  # every batch gets >= min_steps steps
    started, load = time.perf_counter(), os.getloadavg()[0]
    results, sweep, base_lr = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, lrs in (("adamw", args.adamw_lrs), ("lamb", args.lamb_lrs)):
            tried = [run_once(optimizer, float(lr), args.batch, args.batch, tokens // 4, seeds[0], args.warmup,
                              False, Path(tmp) / f"sweep_{optimizer}_{lr}") for lr in lrs.split(",")]
            for r in tried:
                print(f"{optimizer} lr {r['lr']:g} at batch {args.batch}: {r['final']:.4f}", flush=True)
            base_lr[optimizer] = min(tried, key=lambda r: r["final"])["lr"]
            sweep += tried
        for k in multiples:
            for optimizer in ("adamw", "lamb"):
                # The lr factor is chosen on the first seed, then every seed runs with it.
                candidates = [run_once(optimizer, base_lr[optimizer] * math.sqrt(k) * f, args.batch * k, args.batch,
                                       tokens, seeds[0], args.warmup, args.rampup,
                                       Path(tmp) / f"{optimizer}_{k}_{f}_{seeds[0]}") for f in factors]
                best = min(candidates, key=lambda r: r["final"])
                runs = [best] + [run_once(optimizer, best["lr"], args.batch * k, args.batch, tokens, seed,
                                          args.warmup, args.rampup, Path(tmp) / f"{optimizer}_{k}_{seed}")
                                 for seed in seeds[1:]]
                for r in runs:
                    print(f"{optimizer} batch {r['batch']} ({k}B) lr {r['lr']:.3g} seed {r['seed']}: "
                          f"{r['final']:.4f} ({r['steps']} steps, {r['seconds']:.0f} s)", flush=True)
                results += runs
    summary = summarise(results, args.batch, multiples)
    plot(results, summary, args.batch, args.plot)
    print(f"\n{datetime.date.today()}, {os.cpu_count()} cores, {args.threads} thread(s), load average {load:.1f} "
          f"at start; {tokens:,} tokens per run ({args.min_steps}+ steps at {max(multiples)}B); "
          f"{'ramp-up over the warmup; ' if args.rampup else ''}{(time.perf_counter() - started) / 60:.0f} min; "
          f"plot {args.plot}\n")
    print(table(summary, args.batch, results))
    print(f"\nBase learning rates (batch {args.batch}, {tokens // 4:,} tokens): "
          + ", ".join(f"{k} {v:g}" for k, v in base_lr.items()))
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "sweep": sweep, "summary": {
            k: {"largest_within_2pct": v["largest_within_2pct"],
                "by_multiple": {str(m): list(t) for m, t in v["by_multiple"].items()}}
            for k, v in summary.items()}}, indent=1))


if __name__ == "__main__":
    main()

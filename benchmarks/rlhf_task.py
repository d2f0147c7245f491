"""RLHF on the built-in sorting task over several seeds: the reward model's held-out accuracy, and how far
PPO and GRPO raise the true metric (task_score) over the SFT model, with the KL to the reference they pay.

    python benchmarks/rlhf_task.py [--seeds 0 1 2] [--out /tmp/rlhf_task] [--config configs/rlhf_tiny.toml]
                                   [--json rlhf_task.json] [--plot benchmarks/rlhf_task.png] [-- EXTRA OVERRIDES]

Per seed: `polytrain rlhf --config CONFIG --run.seed S` (steps 1-3 with PPO), then step 3 with GRPO
(rlhf.group_size 4) from a copy of the same steps 1-2. task_score is measured on step 3's held-out
prompts, sampled at the rollout temperature, before step 3 (the SFT actor) and after it. Prints one
row per seed and algorithm and the means; the figure draws reward, KL and task_score per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRPO = ["--rlhf.algorithm", "grpo", "--rlhf.group_size", "4"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _polytrain(args: list[str]) -> float:
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "polytrain.cli", "rlhf", *args], check=True, env=env, cwd=ROOT)
    return time.perf_counter() - start


def _summary(run: Path, algorithm: str, seconds: float) -> dict:
    reward = json.loads((run / "reward" / "complete.json").read_text())
    ppo = json.loads((run / "ppo" / "complete.json").read_text())
    steps = [r for r in _rows(run / "ppo" / "metrics.jsonl") if "kl" in r]
    return {"algorithm": algorithm, "rm_accuracy": reward["accuracy"],
            "task_score_sft": ppo["first_eval_task_score"], "task_score_after": ppo["eval_task_score"],
            "reward_sft": ppo["first_eval_reward"], "reward_after": ppo["eval_reward"],
            "kl_final": steps[-1]["kl"], "kl_max": max(r["kl"] for r in steps), "seconds": seconds,
            "curve": [{k: r.get(k) for k in ("step", "reward", "kl", "task_score")} for r in steps]}


def _plot(results: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.6), dpi=100)
    for i, key in enumerate(("reward", "kl", "task_score")):
        ax = fig.add_subplot(1, 3, i + 1)
        for res in results:
            curve = res["curve"]
            ax.plot([c["step"] for c in curve], [c[key] for c in curve], "-" if res["algorithm"] == "ppo" else "--",
                    label=f"{res['algorithm']} seed {res['seed']}", linewidth=1.1)
        ax.set_title(key)
        ax.set_xlabel("step 3 step")
        ax.grid(True, alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("/tmp/rlhf_task"))
    parser.add_argument("--config", default=str(ROOT / "configs" / "rlhf_tiny.toml"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="more --section.key VALUE overrides, after --")
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        run = args.out / f"seed{seed}"
        base = ["--config", args.config, "--run.seed", str(seed), *args.extra]
        seconds = _polytrain([*base, "--run.out_dir", str(run)])
        results.append({"seed": seed, **_summary(run, "ppo", seconds)})
        grpo = args.out / f"seed{seed}_grpo"
        shutil.rmtree(grpo, ignore_errors=True)
        shutil.copytree(run, grpo, ignore=shutil.ignore_patterns("ppo"))
        seconds = _polytrain([*base, "--run.out_dir", str(grpo), *GRPO, "--rlhf.steps", "3"])
        results.append({"seed": seed, **_summary(grpo, "grpo", seconds)})
    print(f"{'seed':>4} {'alg':>5} {'RM acc':>7} {'task SFT':>9} {'after':>7} {'KL end':>7} {'KL max':>7} {'s':>6}")
    for r in results:
        print(f"{r['seed']:>4} {r['algorithm']:>5} {r['rm_accuracy']:7.3f} {r['task_score_sft']:9.3f} "
              f"{r['task_score_after']:7.3f} {r['kl_final']:7.2f} {r['kl_max']:7.2f} {r['seconds']:6.0f}")
    for alg in ("ppo", "grpo"):
        rs = [r for r in results if r["algorithm"] == alg]
        gain = sum(r["task_score_after"] - r["task_score_sft"] for r in rs) / len(rs)
        print(f"mean {alg}: RM accuracy {sum(r['rm_accuracy'] for r in rs) / len(rs):.3f}, task_score "
              f"{sum(r['task_score_sft'] for r in rs) / len(rs):.3f} -> {sum(r['task_score_after'] for r in rs) / len(rs):.3f}"
              f" (+{gain:.3f}), final KL {sum(r['kl_final'] for r in rs) / len(rs):.2f}")
    machine = {"processor": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
               "load_average": os.getloadavg()}
    print(f"machine: {machine}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    if args.plot:
        _plot(results, args.plot)


if __name__ == "__main__":
    main()

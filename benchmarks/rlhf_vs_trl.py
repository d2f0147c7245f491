"""polytrain's RLHF steps 2 and 3 beside TRL's RewardTrainer and GRPOTrainer, same models, same data, one run.

    python benchmarks/rlhf_vs_trl.py [--out /tmp/rlhf_vs_trl] [--reward-steps 100] [--grpo-steps 10] [--sft-steps N]
                                     [--seed S] [--trl-python /work/venvs/rlhf/bin/python] [--json out.json]

1. `polytrain rlhf --config configs/rlhf_tiny.toml --rlhf.steps 1,2`: the SFT actor, then polytrain's reward
   model after --reward-steps steps, with its held-out accuracy.
2. The SFT actor exported to Hugging Face (`polytrain convert --to hf`); the step-2 rows, held-out pairs and
   step-3 prompts as polytrain split them, and the config's hyperparameters, written to OUT/rows.json and
   OUT/settings.json; then benchmarks/programs/trl_rlhf.py, run by --trl-python (TRL is not a polytrain
   dependency): TRL's RewardTrainer trains a LlamaForSequenceClassification from the export for the same
   steps on the same rows (batch, micro-batch, learning rate, warmup as the config's) and scores the same
   held-out pairs (OUT/trl_reward.json).
3. Step 3 with GRPO (group 4, KL coefficient 0.04, token-mean loss = TRL's "dapo") for --grpo-steps steps:
   polytrain against its reward model of step 2, TRL's GRPOTrainer against TRL's (OUT/trl_grpo.json); each in
   its own process, whose peak resident memory is read from wait4. Samples/s over the steps after the first.

TRL 1.16 has no PPO trainer (it moved to trl.experimental), so PPO is not compared. TRL's reward model
scores a sequence at its last non-padding token (the one before the end-of-text, which is also its pad
token), polytrain's at the end-of-text token; the schedules differ in their floor (HF's cosine decays to 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "rlhf_tiny.toml"
TRL_PROGRAM = ROOT / "benchmarks" / "programs" / "trl_rlhf.py"
GRPO = ["--rlhf.algorithm", "grpo", "--rlhf.group_size", "4", "--rlhf.grpo_kl_coef", "0.04"]


def _run(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """Run `cmd` to completion; (seconds, peak resident memory of the process in GiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    return time.perf_counter() - start, usage.ru_maxrss / 2**20  # ru_maxrss: KiB on Linux


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _samples_per_s(times: list[float], samples_per_step: int) -> float:
    """Samples/s over the steps after the first (its set-up cost is not a step's)."""
    return (len(times) - 1) * samples_per_step / (times[-1] - times[0])


def write_inputs(out: Path, cfg, reward_steps: int, grpo_steps: int) -> None:
    """OUT/rows.json (step 2's training and held-out pairs, step 3's prompts, exactly as polytrain splits them)
    and OUT/settings.json (the config's hyperparameters) for the TRL program, which imports nothing of polytrain."""
    from polytrain.data.preference import parse_split, phase_data
    from polytrain.rlhf.task import task_data

    r, t = cfg.rlhf, cfg.train
    data = task_data([], None, cfg.run.seed, r.task_pairs, r.task_demos, r.task_noise)
    split = parse_split(r.data_split)
    reward = phase_data(data.sources, split, "reward", cfg.run.seed, r.eval_rows)
    ppo = phase_data(data.sources, split, "ppo", cfg.run.seed, r.eval_rows)

    def pair(row) -> dict:
        return {"prompt": row.prompt, "chosen": row.chosen, "rejected": row.rejected}

    # the prompts as the model reads them (rlhf.prompt_template; the built-in task's is "{prompt}")
    rows = {"reward_train": [pair(reward[i]) for i in range(len(reward))],
            "reward_held_out": [pair(row) for row in reward.held_out],
            "ppo_prompts": [r.prompt_template.format(prompt=ppo[i].prompt) for i in range(len(ppo))],
            "ppo_held_out": [r.prompt_template.format(prompt=row.prompt) for row in ppo.held_out]}
    (out / "rows.json").write_text(json.dumps(rows))
    settings = {"reward_steps": reward_steps, "grpo_steps": grpo_steps, "seed": cfg.run.seed,
                "reward_batch": t.global_batch_size, "grpo_batch": t.global_batch_size,
                "micro_batch": t.micro_batch_size, "warmup_steps": t.warmup_steps, "weight_decay": t.weight_decay,
                "beta1": t.beta1, "beta2": t.beta2, "grad_clip": t.grad_clip,
                "reward_lr": r.reward_lr or t.lr, "actor_lr": r.actor_lr or t.lr, "group_size": 4,
                "kl_coef": 0.04, "policy_clip": r.policy_clip, "max_new_tokens": r.max_new_tokens,
                "temperature": r.temperature}
    (out / "settings.json").write_text(json.dumps(settings, indent=1))


# ----- the driver -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/rlhf_vs_trl"))
    parser.add_argument("--reward-steps", type=int, default=100)
    parser.add_argument("--grpo-steps", type=int, default=10)
    parser.add_argument("--sft-steps", type=int, default=0, help="step 1's steps (0 = the config's)")
    parser.add_argument("--trl-python", default="/work/venvs/rlhf/bin/python")
    parser.add_argument("--seed", type=int, default=None, help="run.seed (default: the config's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from polytrain.config import load_config

    cfg = load_config(CONFIG)
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=args.seed))
    out = args.out
    run = out / "polytrain"
    for old in (run, out / "sft_hf", out / "trl_rm"):  # a finished polytrain step would be skipped: start afresh
        shutil.rmtree(old, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    polytrain = [sys.executable, "-m", "polytrain.cli"]
    base = ["rlhf", "--config", str(CONFIG), "--run.out_dir", str(run), "--rlhf.reward_steps", str(args.reward_steps),
            # held-out evaluations at the ends only, as TRL's
            "--run.seed", str(cfg.run.seed), "--run.log_every", "1", "--run.eval_every", "0",
            *(["--rlhf.sft_steps", str(args.sft_steps)] if args.sft_steps else [])]
    _run(polytrain + base + ["--rlhf.steps", "1,2"])
    subprocess.run(polytrain + ["convert", "--to", "hf", str(run / "sft"), str(out / "sft_hf")], check=True,
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    write_inputs(out, cfg, args.reward_steps, args.grpo_steps)
    trl = [args.trl_python, str(TRL_PROGRAM)]
    _run(trl + ["reward", str(out)])
    _, ours_peak = _run(polytrain + base + GRPO + ["--rlhf.steps", "3", "--rlhf.ppo_steps", str(args.grpo_steps)])
    _, trl_peak = _run(trl + ["grpo", str(out)])

    g = cfg.train.global_batch_size  # samples (pairs, responses) per step
    reward_rows = _rows(run / "reward" / "metrics.jsonl")
    ours_rm = json.loads((run / "reward" / "complete.json").read_text())["accuracy"]
    ours_rm_speed = _samples_per_s([x["time"] for x in reward_rows if "loss" in x], g)
    ours_grpo = _samples_per_s([x["time"] for x in _rows(run / "ppo" / "metrics.jsonl") if "kl" in x], g)
    trl_rm, trl_grpo = (json.loads((out / f"trl_{k}.json").read_text()) for k in ("reward", "grpo"))
    from polytrain.data.sort_task import task_score

    held = json.loads((out / "rows.json").read_text())["ppo_held_out"]

    def true_metric(texts: list[str]) -> float:  # the share of held-out prompts answered right
        return sum(task_score(prompt, text) for prompt, text in zip(held, texts, strict=True)) / len(held)

    ours_step3 = json.loads((run / "ppo" / "complete.json").read_text())
    table = {
        "reward_steps": args.reward_steps, "grpo_steps": args.grpo_steps, "seed": cfg.run.seed,
        "rm_accuracy": {"polytrain": ours_rm, "trl": trl_rm["accuracy"]},
        "rm_pairs_per_s": {"polytrain": ours_rm_speed, "trl": trl_rm["samples_per_s"],
                           "ratio": ours_rm_speed / trl_rm["samples_per_s"]},
        "grpo_task_score_before_after": {
            "polytrain": [ours_step3["first_eval_task_score"], ours_step3["eval_task_score"]],
            "trl": [true_metric(trl_grpo["held_out_before"]), true_metric(trl_grpo["held_out_after"])]},
        "grpo_batch_reward_first_last": {"trl": [trl_grpo["reward_first"], trl_grpo["reward_last"]]},
        "grpo_samples_per_s": {"polytrain": ours_grpo, "trl": trl_grpo["samples_per_s"],
                               "ratio": ours_grpo / trl_grpo["samples_per_s"]},
        "grpo_peak_rss_gib": {"polytrain": ours_peak, "trl": trl_peak, "ratio": ours_peak / trl_peak},
        "machine": {"processor": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
                    "load_average": os.getloadavg()},
    }
    print(json.dumps(table, indent=1))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()

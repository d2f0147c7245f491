"""`polytrain rlhf`: the three InstructGPT steps in order in one run directory, each skipped once finished.

    polytrain rlhf [--config FILE.toml] [--section.key VALUE ...]      # steps 1, 2, 3 in runs/<name>/
    polytrain rlhf --rlhf.steps 3 --rlhf.algorithm grpo                # step 3 again, from steps 1-2's outputs
    polytrain rlhf --parallel.nproc 4 ...                              # 4 local workers, as polytrain train

`check_rlhf` is the start-up check (the command line runs it before starting workers,
every worker again): the step list, the steps' inputs (a step whose inputs are neither
finished nor about to run is one line naming the step to run), and every model's layout
on the world. `run_rlhf` then runs each unfinished step (sft.py, reward.py, ppo.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from polytrain.backend import get_accelerator
from polytrain.config import Config
from polytrain.data.preference import parse_split
from polytrain.distributed.world import init_world
from polytrain.rlhf.context import RLHFRun
from polytrain.rlhf.plan import COMPLETE, STEPS, check_inputs, is_complete, parse_steps, step_dir
from polytrain.rlhf.ppo import check_hybrid_engine, run_ppo, step3_configs
from polytrain.rlhf.ppo_engine import check_mini_batches
from polytrain.rlhf.reward import run_reward
from polytrain.rlhf.roles import role_config
from polytrain.rlhf.sft import run_sft
from polytrain.rlhf.sources import import_if_hf, planned_models
from polytrain.train.loggers import require_loggers
from polytrain.train.startup import plan_layout

RUNNERS = {"sft": run_sft, "reward": run_reward, "ppo": run_ppo}


def check_rlhf(cfg: Config, world_size: int) -> tuple[str, ...]:
    """The steps to run, after checking their inputs and every model's layout on `world_size` processes."""
    r = cfg.rlhf
    steps = parse_steps(r.steps)
    require_loggers(cfg)
    check_inputs(cfg.run_dir, steps)
    parse_split(r.data_split)
    actor, reward = planned_models(cfg)
    lr, n = cfg.train.lr, cfg.run.steps
    configs = [role_config(cfg, "actor", actor, lr=lr, steps=n), role_config(cfg, "reward", reward, lr=lr, steps=n)]
    trained_in_step3 = {}
    if "ppo" in steps:
        step3 = step3_configs(cfg, cfg.run_dir, actor, reward)
        configs += step3.values()
        check_hybrid_engine(cfg, actor, world_size)
        trained_in_step3 = {name: step3[name] for name in ("actor", "critic") if name in step3}
    for step_cfg in configs:
        plan_layout(step_cfg, world_size)
    if trained_in_step3:
        check_mini_batches(cfg.rlhf.ppo_mini_batches, cfg.train.global_batch_size,
                           {name: plan_layout(c, world_size).batch.dp for name, c in trained_in_step3.items()})
    return steps


def run_rlhf(cfg: Config) -> dict[str, dict[str, Any]]:
    """Run the unfinished steps of rlhf.steps on the job the environment describes; their summaries."""
    steps = check_rlhf(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if os.environ.get("RANK", "0") == "0":  # before the others join: import HF models once
        import_if_hf(cfg.rlhf.actor_from, cfg.run_dir, "actor")
        import_if_hf(cfg.rlhf.reward_from, cfg.run_dir, "reward")
    acc = get_accelerator()
    world = init_world(acc)
    torch.manual_seed(cfg.run.seed)
    acc.manual_seed(cfg.run.seed)
    run = RLHFRun.open(cfg, acc, world)
    summaries = {}
    for step in steps:
        number = STEPS.index(step) + 1
        if is_complete(cfg.run_dir, step):
            if world.is_main:
                print(f"step {number} ({step}): {step_dir(cfg.run_dir, step)} is complete; skipped", flush=True)
            summaries[step] = json.loads((step_dir(cfg.run_dir, step) / COMPLETE).read_text())
            continue
        if world.is_main:
            print(f"step {number} ({step}) -> {step_dir(cfg.run_dir, step)}", flush=True)
        summaries[step] = RUNNERS[step](run)
    return summaries


def summary_lines(cfg: Config, summaries: dict[str, dict[str, Any]]) -> list[str]:
    """What the run did, a line per step, and how to talk to the result."""
    lines = []
    if "sft" in summaries:
        s = summaries["sft"]
        lines.append(f"step 1 (sft): {s['step']} steps, held-out loss {s['val_loss']:.3f}")
    if "reward" in summaries:
        s = summaries["reward"]
        lines.append(f"step 2 (reward): {s['step']} steps, held-out accuracy {s['accuracy']:.3f} (chosen "
                     f"{s['chosen_score']:.2f}, rejected {s['rejected_score']:.2f})")
    if "ppo" in summaries:
        s = summaries["ppo"]
        score = s.get("eval_task_score")
        before = s.get("first_eval_task_score")
        shown = f", held-out task_score {before:.3f} -> {score:.3f}" if score is not None and before is not None else ""
        lines.append(f"step 3 ({cfg.rlhf.algorithm}): {s['step']} steps, held-out reward {s['eval_reward']:.3f}{shown}")
    lines.append(f"talk to it: polytrain chat {cfg.run_dir}")
    return lines

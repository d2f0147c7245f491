"""Step 2: the reward model (runs/<name>/reward).

A value model (the actor's decoder with a (1, dim) scalar head, or a smaller one:
rlhf.reward_from) learns to score step 2's preference pairs: -log sigmoid(r_chosen -
r_rejected) of the scores at the last tokens (rlhf.reward_loss = "end"), or DeepSpeed-Chat's
mean over the divergent span ("span"). The chosen and rejected sequences of a micro-batch
run as one (2b, T) batch. Metrics: `loss` and the batch `accuracy` per step; on step 2's
held-out pairs `accuracy` (chosen scored above rejected), `chosen_score`, `rejected_score`;
loss.png and reward.png.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from polytrain.checkpoint import RunDir
from polytrain.config import Config, load_config
from polytrain.distributed.world import mean_over_world
from polytrain.rlhf import losses
from polytrain.rlhf.batches import pair_batch
from polytrain.rlhf.context import RLHFRun
from polytrain.rlhf.exchange import row_range
from polytrain.rlhf.plan import step_dir
from polytrain.rlhf.plots import plot_panels
from polytrain.rlhf.roles import RoleModel, build_role, role_config
from polytrain.rlhf.sources import Start, reward_start
from polytrain.rlhf.stepdir import StepRun, checkpoint_path
from polytrain.rlhf.supervised import supervised_loop
from polytrain.train.metrics import plot_loss

Pair = tuple[list[int], list[int]]
"""(chosen ids, rejected ids), each prompt + response + end-of-text."""


def reward_model_start(run: RLHFRun) -> Start:
    """Step 2's starting reward model: rlhf.reward_from, by default the finished SFT actor."""
    sft = checkpoint_path(run.run_dir, "sft") if not run.cfg.rlhf.reward_from else None
    return reward_start(run.cfg, run.actor.model, sft, run.run_dir)


def trained_reward_model(run: RLHFRun) -> Start:
    """Step 2's finished reward model: its model (runs/<name>/reward/config.toml) and final checkpoint."""
    model = load_config(RunDir(step_dir(run.run_dir, "reward")).require_config()).model
    return Start(model, checkpoint_path(run.run_dir, "reward"))


def reward_config(run: RLHFRun, start: Start) -> Config:
    """Step 2's config: the reward model's model and layout (rlhf.reward_*), rlhf.reward_lr and reward_steps."""
    cfg, r = run.cfg, run.cfg.rlhf
    step_cfg = role_config(cfg, "reward", start.model, lr=r.reward_lr or cfg.train.lr,
                           steps=r.reward_steps or cfg.run.steps)
    return dataclasses.replace(step_cfg, run=dataclasses.replace(step_cfg.run, out_dir=str(step_dir(run.run_dir, "reward"))))


def pair_scores(role: RoleModel, pairs: Sequence[Pair], pad_id: int, span: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen scores (b,), rejected scores (b,), mean loss) of some pairs: one forward over the 2b sequences."""
    ids, lengths = pair_batch(pairs, pad_id)
    ids, lengths = ids.to(role.runtime.device), lengths.to(role.runtime.device)
    values = role.values(ids)  # (2b, T)
    b = len(pairs)
    scores = losses.end_scores(values, lengths)
    chosen, rejected = scores[:b], scores[b:]
    if span:
        loss = losses.span_pairwise_loss(values[:b], values[b:], ids[:b], ids[b:], lengths[:b], lengths[b:])
    else:
        loss = losses.pairwise_loss(chosen, rejected)
    return chosen, rejected, loss


def pairs_pass(role: RoleModel, batch: Sequence[Pair], pad_id: int, span: bool, train: bool) -> dict[str, float]:
    """Mean loss, accuracy and scores over a global batch of pairs; with `train`, backward through this
    rank's share in micro-batches. Every rank returns the batch's values."""
    dp = role.runtime.dp_size
    mine = [batch[i] for i in row_range(len(batch), role.runtime)]
    mbs = role.batch.micro_batch_size
    chunks = [mine[i:i + mbs] for i in range(0, len(mine), mbs)]
    sums = torch.zeros(4, device=role.runtime.device)  # loss, correct, chosen, rejected: this rank's share
    for k, chunk in enumerate(chunks):
        weight = len(chunk) * dp / len(batch)  # the chunk's share of the batch's pairs
        if train:
            role.before_micro_batch(last=k == len(chunks) - 1)
            chosen, rejected, loss = pair_scores(role, chunk, pad_id, span)
            role.backward(loss * weight)
        else:
            with torch.no_grad():
                chosen, rejected, loss = pair_scores(role, chunk, pad_id, span)
        sums += torch.stack([loss.detach() * weight, *(x.detach().float().mean() * weight for x in
                                                        ((chosen > rejected), chosen, rejected))])
    loss, accuracy, chosen, rejected = mean_over_world(sums).tolist()
    return {"loss": loss, "accuracy": accuracy, "chosen_score": chosen, "rejected_score": rejected}


def run_reward(run: RLHFRun) -> dict[str, Any]:
    """Step 2 (module docstring); returns its summary (complete.json)."""
    start = reward_model_start(run)
    cfg = reward_config(run, start)
    step = StepRun(run, "reward", cfg)
    role = build_role(run.acc, run.world, cfg, "reward", None if step.resume_from else start, run_dir=step.dir)
    data = run.phase("reward")
    pairs = [run.encoder.pair(data[i]) for i in range(len(data))]
    held = [run.encoder.pair(row) for row in data.held_out]
    dp = role.runtime.dp_size
    held = held[: len(held) // dp * dp] or pairs[:dp]
    span = cfg.rlhf.reward_loss == "span"

    def train_batch(indices: list[int]) -> dict[str, float]:
        stats = pairs_pass(role, [pairs[i] for i in indices], run.pad_id, span, train=True)
        return {"loss": stats["loss"], "train_accuracy": stats["accuracy"]}

    def evaluate() -> dict[str, float]:
        """Held-out metrics as the rows carry them: the loss as val_loss, beside the training loss."""
        role.model.eval()
        stats = pairs_pass(role, held, run.pad_id, span, train=False)
        return {"val_loss": stats.pop("loss"), **stats}

    summary = supervised_loop(step, role, len(pairs), train_batch, evaluate)
    if run.world.is_main:
        plot_loss(step.dir)
        plot_panels(step.dir, "reward.png", ("accuracy", ("chosen_score", "rejected_score")))
    return step.finish(summary)


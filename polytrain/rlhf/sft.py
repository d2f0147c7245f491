"""Step 1: supervised fine-tuning of the actor on demonstrations (runs/<name>/sft).

The actor (rlhf.actor_from, or the [model] preset) learns next-token prediction on step 1's
rows: demonstration rows and the chosen answers of step 1's part of every preference
source. DeepSpeed-Chat scores the prompt tokens too; rlhf.sft_mask_prompt scores only the
response. The loss of a step is the mean over every scored token of its global batch
(each micro-batch weighted by its share of the tokens), so layouts agree exactly.
Metrics: `loss` per step, `val_loss` on step 1's held-out rows; loss.png.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from polytrain.config import Config
from polytrain.distributed.world import mean_over_world
from polytrain.rlhf.batches import sft_batch
from polytrain.rlhf.context import RLHFRun
from polytrain.rlhf.exchange import row_range
from polytrain.rlhf.plan import step_dir
from polytrain.rlhf.roles import RoleModel, build_role, role_config
from polytrain.rlhf.stepdir import StepRun
from polytrain.rlhf.supervised import supervised_loop
from polytrain.train.metrics import plot_loss

Example = tuple[list[int], int]
"""(prompt + response + end-of-text ids, prompt length)."""


def sft_config(run: RLHFRun) -> Config:
    """Step 1's config: the actor's model and layout, rlhf.sft_lr and rlhf.sft_steps."""
    cfg, r = run.cfg, run.cfg.rlhf
    step_cfg = role_config(cfg, "actor", run.actor.model, lr=r.sft_lr or cfg.train.lr, steps=r.sft_steps or cfg.run.steps)
    return dataclasses.replace(step_cfg, run=dataclasses.replace(step_cfg.run, out_dir=str(step_dir(run.run_dir, "sft"))))


def _scored(example: Example, mask_prompt: bool) -> int:
    """Tokens the loss scores: every next token, or (mask_prompt) the response's and the end-of-text."""
    ids, prompt_len = example
    return len(ids) - (prompt_len if mask_prompt else 1)


def lm_loss_of_batch(role: RoleModel, batch: Sequence[Example], pad_id: int, mask_prompt: bool,
                     scale: float = 1.0, train: bool = True) -> float:
    """The token-weighted mean next-token loss of a global batch; with `train`, backward through this
    rank's share (times `scale`) in micro-batches. Returns the batch's mean (the same on every rank)."""
    count = sum(_scored(e, mask_prompt) for e in batch) / role.runtime.dp_size
    mine = [batch[i] for i in row_range(len(batch), role.runtime)]
    mbs = role.batch.micro_batch_size
    chunks = [mine[i:i + mbs] for i in range(0, len(mine), mbs)]
    share = torch.zeros((), device=role.runtime.device)
    for k, chunk in enumerate(chunks):
        weight = sum(_scored(e, mask_prompt) for e in chunk) / count  # this chunk's share of the batch's tokens
        inputs, targets = sft_batch(chunk, pad_id, mask_prompt)
        if train:
            role.before_micro_batch(last=k == len(chunks) - 1)
            loss = role.lm_loss(inputs, targets) * weight
            role.backward(loss * scale)
        else:
            with torch.no_grad():
                loss = role.lm_loss(inputs, targets) * weight
        share += loss.detach()
    return mean_over_world(share).item()


def run_sft(run: RLHFRun) -> dict[str, Any]:
    """Step 1 (module docstring); returns its summary (complete.json)."""
    cfg = sft_config(run)
    step = StepRun(run, "sft", cfg)
    actor = build_role(run.acc, run.world, cfg, "actor", None if step.resume_from else run.actor, run_dir=step.dir)
    data = run.phase("sft")
    examples = [run.encoder.sft(data[i]) for i in range(len(data))]
    held = [run.encoder.sft(row) for row in data.held_out]
    held = held[: len(held) // actor.runtime.dp_size * actor.runtime.dp_size] or examples[: actor.runtime.dp_size]
    mask = cfg.rlhf.sft_mask_prompt

    def train_batch(indices: list[int]) -> dict[str, float]:
        return {"loss": lm_loss_of_batch(actor, [examples[i] for i in indices], run.pad_id, mask)}

    def evaluate() -> dict[str, float]:
        actor.model.eval()
        return {"val_loss": lm_loss_of_batch(actor, held, run.pad_id, mask, train=False)}

    summary = supervised_loop(step, actor, len(examples), train_batch, evaluate)
    if run.world.is_main:
        plot_loss(step.dir)
    return step.finish(summary)

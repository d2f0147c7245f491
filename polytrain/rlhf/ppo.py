"""One step of step 3, as DeepSpeed-Chat runs it: experience from a rollout, then the actor's and the critic's losses.

    rollout = rollout(actor, prompts, ...)                         # rollout.py
    exp = make_experience(rollout, models, cfg.rlhf)               # one no-grad pass of the four models
    loss, stats = actor_objective(models.actor, exp, cfg.rlhf, count)      # backward, step
    value = critic_objective(models.critic, exp, cfg.rlhf, count)          # backward, step (PPO only)

PPO: per-token rewards -kl_coef (log pi - log pi_ref) with the clipped reward-model score
at the last response token, GAE advantages against the critic's values, PPO's clipped
surrogate and the clipped value loss. GRPO: `group_size` samples per prompt (consecutive
rows), each scored by the reward model, advantages (score - group mean) / group std for
every token of the response, no critic; the KL to the reference enters the loss as GRPO's
k3 penalty (coefficient grpo_kl_coef) instead of the reward.

`count` is the number of response tokens in the whole global batch divided by the number
of data-parallel ranks, so that averaging the ranks' gradients gives the global mean
(losses.masked_mean).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from polytrain.config import RLHFConfig
from polytrain.rlhf import losses
from polytrain.rlhf.rollout import Rollout

LogprobFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""(model, ids (B, T)) -> log-probabilities (B, T - 1) of ids[:, 1:] (vocabulary-parallel under tp)."""


def plain_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities from a model that returns whole logits (B, T - 1, V)."""
    return losses.token_logprobs(model(ids[:, :-1]), ids[:, 1:])


@dataclass
class Models:
    """The four models of step 3 (critic None for GRPO), each called as model(ids)."""

    actor: nn.Module
    reference: nn.Module
    reward: nn.Module
    critic: nn.Module | None = None
    logprobs: LogprobFn = plain_logprobs


@dataclass
class Experience:
    """Everything the losses need from one rollout, computed without gradients."""

    rollout: Rollout
    old_logprobs: torch.Tensor
    """(B, T - 1) the actor's log-probabilities before this step's update."""
    ref_logprobs: torch.Tensor
    scores: torch.Tensor
    """(B,) the reward model's score of each sequence, clipped to +-reward_clip."""
    advantages: torch.Tensor
    """(B, T - 1), 0 outside the response."""
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        return self.rollout.mask


@torch.no_grad()
def make_experience(rollout: Rollout, models: Models, settings: RLHFConfig) -> Experience:
    """The no-grad pass: actor and reference log-probabilities, the reward score, critic values, advantages."""
    ids, mask = rollout.ids, rollout.mask
    old = models.logprobs(models.actor, ids)
    ref = models.logprobs(models.reference, ids)
    raw = losses.end_scores(models.reward(ids).float(), rollout.lengths)  # (B,)
    scores = raw.clamp(-settings.reward_clip, settings.reward_clip)
    if settings.algorithm == "grpo":
        adv = losses.group_advantages(scores, settings.group_size)[:, None] * mask
        return Experience(rollout, old, ref, scores, adv)
    values = models.critic(ids)[:, :-1].float() * mask  # (B, T - 1): value of the state after token t
    rewards = losses.kl_penalized_rewards(old, ref, raw, mask, settings.kl_coef, settings.reward_clip)
    adv, returns = losses.gae(rewards, values, mask, settings.gamma, settings.lam)
    return Experience(rollout, old, ref, scores, adv, values, returns)


def actor_objective(actor: nn.Module, exp: Experience, settings: RLHFConfig, count: float,
                    logprobs: LogprobFn = plain_logprobs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss on this rank's rows (to backward) and its parts: policy_loss, clip_frac, (kl_loss)."""
    new = logprobs(actor, exp.rollout.ids)
    loss, clip_frac = losses.policy_loss(new, exp.old_logprobs, exp.advantages, exp.mask,
                                         settings.policy_clip, count)
    stats = {"policy_loss": loss.detach(), "clip_frac": clip_frac}
    if settings.algorithm == "grpo":
        kl = losses.masked_mean(losses.kl_estimate(new, exp.ref_logprobs), exp.mask, count)
        stats["kl_loss"] = kl.detach()
        loss = loss + settings.grpo_kl_coef * kl
    return loss, stats


def critic_objective(critic: nn.Module, exp: Experience, settings: RLHFConfig, count: float) -> torch.Tensor:
    """The critic's clipped value loss on this rank's rows."""
    values = critic(exp.rollout.ids)[:, :-1]
    return losses.value_loss(values, exp.old_values, exp.returns, exp.mask, settings.value_clip, count)


def sequence_kl(exp: Experience) -> torch.Tensor:
    """(B,) each response's summed log pi - log pi_ref: the KL of the sample to the reference."""
    return ((exp.old_logprobs - exp.ref_logprobs) * exp.mask).sum(1)

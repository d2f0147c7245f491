"""Step 3's arithmetic on one rollout, as DeepSpeed-Chat does it: experience, then the actor's and the critic's losses.

    exp = make_experience(rollout, old_logprobs, ref_logprobs, scores, values, cfg.rlhf)  # no grad, whole batch
    loss, stats = actor_loss(new_logprobs, exp.rows(mine), cfg.rlhf, count)            # backward, step
    value = critic_loss(new_values, exp.rows(mine), cfg.rlhf, count)                   # backward, step (PPO)

PPO: per-token rewards -kl_coef (log pi - log pi_ref) with the clipped reward-model score
at the last response token, GAE advantages against the critic's values, PPO's clipped
surrogate and the clipped value loss. GRPO: `group_size` samples per prompt (consecutive
rows), each scored by the reward model, advantages (score - group mean) / group std for
every token of the response, no critic; the KL to the reference enters the loss as GRPO's
k3 penalty (coefficient grpo_kl_coef) instead of the reward.

`count` is the number of response tokens in the whole global batch divided by the number
of data-parallel ranks, so that averaging the ranks' gradients gives the global mean
(losses.masked_mean), whatever rows and micro-batches each rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polytrain.config import RLHFConfig
from polytrain.rlhf import losses
from polytrain.rlhf.rollout import Rollout


@dataclass
class Experience:
    """Everything the losses need from one rollout, computed without gradients; (B, T - 1) per token."""

    rollout: Rollout
    old_logprobs: torch.Tensor
    """The actor's log-probabilities of the sampled tokens before this step's updates, at the sampling temperature."""
    ref_logprobs: torch.Tensor
    scores: torch.Tensor
    """(B,) the reward model's score of each sequence, clipped to +-reward_clip."""
    advantages: torch.Tensor
    """0 outside the response."""
    old_values: torch.Tensor | None = None
    """PPO: the critic's values at the rollout (the value clip's centre)."""
    returns: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        return self.rollout.mask

    def rows(self, index: range | slice) -> Experience:
        """The experience of some rows (a rank's slice, a micro-batch)."""
        if isinstance(index, range):
            index = slice(index.start, index.stop)
        pick = (lambda x: None if x is None else x[index])
        return Experience(self.rollout.rows(index), self.old_logprobs[index], self.ref_logprobs[index],
                          self.scores[index], self.advantages[index], pick(self.old_values), pick(self.returns))


@torch.no_grad()
def make_experience(rollout: Rollout, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                    raw_scores: torch.Tensor, values: torch.Tensor | None, settings: RLHFConfig) -> Experience:
    """Advantages (and PPO's returns) from the four models' outputs on the whole batch.

    old_logprobs, ref_logprobs (B, T - 1); raw_scores (B,) the reward model's end scores;
    values (B, T - 1) the critic's value of the state after token t (None for GRPO).
    """
    mask = rollout.mask
    scores = raw_scores.float().clamp(-settings.reward_clip, settings.reward_clip)
    if settings.algorithm == "grpo":
        adv = losses.group_advantages(scores, settings.group_size)[:, None] * mask
        return Experience(rollout, old_logprobs, ref_logprobs, scores, adv)
    values = values.float() * mask
    rewards = losses.kl_penalized_rewards(old_logprobs, ref_logprobs, raw_scores, mask, settings.kl_coef,
                                          settings.reward_clip)
    adv, returns = losses.gae(rewards, values, mask, settings.gamma, settings.lam)
    return Experience(rollout, old_logprobs, ref_logprobs, scores, adv, values, returns)


def actor_loss(new_logprobs: torch.Tensor, exp: Experience, settings: RLHFConfig,
               count: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss on `exp`'s rows (to backward) and its parts: policy_loss, clip_frac, (kl_loss)."""
    loss, clip_frac = losses.policy_loss(new_logprobs, exp.old_logprobs, exp.advantages, exp.mask,
                                         settings.policy_clip, count)
    stats = {"policy_loss": loss.detach(), "clip_frac": clip_frac}
    if settings.algorithm == "grpo":
        kl = losses.masked_mean(losses.kl_estimate(new_logprobs, exp.ref_logprobs), exp.mask, count)
        stats["kl_loss"] = kl.detach()
        loss = loss + settings.grpo_kl_coef * kl
    return loss, stats


def critic_loss(new_values: torch.Tensor, exp: Experience, settings: RLHFConfig, count: float) -> torch.Tensor:
    """The critic's clipped value loss on `exp`'s rows; new_values (b, T - 1)."""
    return losses.value_loss(new_values, exp.old_values, exp.returns, exp.mask, settings.value_clip, count)


def sequence_kl(exp: Experience) -> torch.Tensor:
    """(B,) each response's summed log pi - log pi_ref: the KL of the sample to the reference."""
    return ((exp.old_logprobs - exp.ref_logprobs) * exp.mask).sum(1)


def sampled_entropy(exp: Experience) -> torch.Tensor:
    """The sampled tokens' mean -log pi: an unbiased estimate of the per-token entropy of the policy the
    rollout sampled from, at rlhf.temperature (no vocabulary-wide pass, so the same under tensor parallelism)."""
    return -losses.masked_mean(exp.old_logprobs, exp.mask)

"""The arithmetic of RLHF: reward-model losses, per-token rewards, GAE, the clipped PPO losses, GRPO.

Every per-token tensor here is laid out like a causal LM's shifted outputs over a
right-padded batch of sequences `prompt + response + padding`: position t holds what
the model says about token t + 1 (its log-probability, or the value of the state
after token t). `mask` (B, T) is True at the positions that score a response token,
so a row's response is the contiguous run of True from its prompt length - 1 onwards.
Reductions over tokens are masked means: padding and prompt positions never count.

The defaults are DeepSpeed-Chat's (KL coefficient 0.1, reward clip 5, gamma 1,
lambda 0.95, policy and value clip 0.2, no advantage whitening).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (bf16/fp16 model outputs are widened; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, count: float | torch.Tensor | None = None) -> torch.Tensor:
    """Mean of x over the True positions of mask (same shape); 0 when mask is empty.

    `count` replaces the number of True positions as the divisor: a rank holding part of
    a batch divides its sum by the whole batch's count, so the ranks' losses add up to
    the batch's mean whatever the layout.
    """
    mask = mask.to(x.dtype)
    return (x * mask).sum() / (mask.sum().clamp(min=1) if count is None else count)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[b, t] | logits[b, t]): logits (B, T, V), tokens (B, T) -> (B, T), in fp32."""
    logp = F.log_softmax(_wide(logits), dim=-1)  # (B, T, V)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def tempered_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                      logprobs_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_logprobs) -> torch.Tensor:
    """log p(tokens) under softmax(logits / temperature), the distribution a rollout sampled from at
    `temperature`: logits (B, T, V, or this rank's V / tp for a vocabulary-parallel `logprobs_of`),
    tokens (B, T) -> (B, T), fp32. Temperature 0 (greedy sampling) and 1 score the logits as they are.
    """
    if temperature not in (0, 1):
        logits = _wide(logits) / temperature  # widened first: a bf16 division would round every logit
    return logprobs_of(logits, tokens)


def last_position(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) one-hot of each row's last True position (all False for an empty row)."""
    counts = mask.long().cumsum(1)  # (B, T)
    return mask & (counts == counts[:, -1:])


def end_scores(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A reward model's score of each sequence: its value at the last real token.

    values (B, T) over right-padded sequences of `lengths` (B,) tokens -> (B,).
    """
    return values.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry loss -mean log sigmoid(r_chosen - r_rejected) over pairs: (B,), (B,) -> scalar."""
    return -F.logsigmoid(_wide(chosen) - _wide(rejected)).mean()


def divergence_start(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor,
                     chosen_len: torch.Tensor, rejected_len: torch.Tensor) -> torch.Tensor:
    """First position where two right-padded sequences differ (B,); a prefix ends at its length.

    Positions past a sequence's length count as different from any real token of the
    other sequence, as DeepSpeed-Chat's comparison of padded ids does.
    """
    T = chosen_ids.shape[1]
    pos = torch.arange(T, device=chosen_ids.device)[None, :]  # (1, T)
    c_real, r_real = pos < chosen_len[:, None], pos < rejected_len[:, None]  # (B, T)
    differ = (c_real != r_real) | (c_real & (chosen_ids != rejected_ids))
    # Identical pairs (no difference) get T - 1: DeepSpeed-Chat then scores the last position only.
    first = torch.where(differ, pos, torch.full_like(pos, T)).min(1).values
    return torch.where(first == T, torch.full_like(first, T - 1), first)


def span_pairwise_loss(chosen_values: torch.Tensor, rejected_values: torch.Tensor,
                       chosen_ids: torch.Tensor, rejected_ids: torch.Tensor,
                       chosen_len: torch.Tensor, rejected_len: torch.Tensor) -> torch.Tensor:
    """DeepSpeed-Chat's reward loss: -log sigmoid(r_c[t] - r_r[t]) averaged over each pair's divergent
    span, from the first differing token to the end of the longer sequence, then over pairs.

    values (B, T) per position of right-padded ids (B, T); lengths (B,) real tokens per row.
    An identical pair (no difference at all) spans only its last position.
    """
    T = chosen_ids.shape[1]
    pos = torch.arange(T, device=chosen_ids.device)[None, :]  # (1, T)
    start = divergence_start(chosen_ids, rejected_ids, chosen_len, rejected_len)  # (B,)
    same = start == T - 1
    end = torch.where(same, torch.full_like(start, T), torch.maximum(chosen_len, rejected_len))
    span = (pos >= start[:, None]) & (pos < end[:, None])  # (B, T)
    per_token = -F.logsigmoid(_wide(chosen_values) - _wide(rejected_values))  # (B, T)
    per_pair = (per_token * span).sum(1) / span.sum(1).clamp(min=1)  # (B,)
    return per_pair.mean()


def kl_penalized_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, scores: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float = 0.1, clip: float = 5.0) -> torch.Tensor:
    """Per-token rewards r_t = -kl_coef (log pi - log pi_ref), plus clip(score, +-clip) at each row's
    last response token; 0 outside the mask. logprobs, ref_logprobs, mask (B, T), scores (B,) -> (B, T)."""
    rewards = -kl_coef * (_wide(logprobs) - _wide(ref_logprobs))
    bonus = _wide(scores).clamp(-clip, clip)[:, None] * last_position(mask)  # (B, T)
    return (rewards + bonus) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's response: (advantages, returns), (B, T) each.

    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, returns = A + V, with
    V = 0 past the response's last token (the episode ends there); both are 0 outside the mask.
    """
    m = mask.to(torch.float32)
    rewards, values = _wide(rewards) * m, _wide(values) * m
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # (B,) A_{t+1}
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # Outside the mask the running sum restarts: prompt and padding positions carry nothing.
        running = (delta + gamma * lam * running) * m[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * m


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip: float = 0.2,
                count: float | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate: (loss, clip fraction), masked means over (B, T) tokens (`count`: as
    masked_mean's).

    ratio = exp(log pi - log pi_old); loss = mean max(-A ratio, -A clip(ratio, 1 - clip, 1 + clip));
    the clip fraction is the share of tokens where the clipped term is the larger (no gradient).
    """
    ratio = torch.exp(_wide(logprobs) - _wide(old_logprobs))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask, count)
    return loss, masked_mean((clipped > unclipped).float(), mask, count).detach()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float = 0.2, count: float | torch.Tensor | None = None) -> torch.Tensor:
    """The critic's clipped loss 0.5 mean max((V - R)^2, (clip(V, V_old +- clip) - R)^2) over the mask
    (`count`: as masked_mean's)."""
    values = _wide(values)
    clipped = torch.maximum(torch.minimum(values, old_values + clip), old_values - clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask, count)


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: each score minus its group's mean, over the group's sample standard deviation + eps.

    scores (B,) with the group_size samples of one prompt consecutive -> (B,).
    """
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} scores do not form groups of {group_size} (>= 2) samples")
    groups = _wide(scores).view(-1, group_size)  # (prompts, G)
    mean, std = groups.mean(1, keepdim=True), groups.std(1, keepdim=True)  # std: unbiased (n - 1)
    return ((groups - mean) / (std + eps)).flatten()


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate exp(q) - q - 1 with q = log pi_ref - log pi (non-negative,
    unbiased under samples of pi: Schulman's k3, GRPO's penalty). (B, T) -> (B, T)."""
    q = _wide(ref_logprobs) - _wide(logprobs)
    return torch.expm1(q) - q  # expm1: no cancellation for small q

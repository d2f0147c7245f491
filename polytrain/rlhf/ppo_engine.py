"""One step of step 3 on one world: a rollout, one no-grad pass of the four models, PPO's updates on it.

    engine = PPOEngine(actor, reference, reward, critic, cfg.rlhf, generation, pad_id)
    stats, exp = engine.step(prompts, sample_ids, step)     # the global batch's prompts, every rank
    stats["time_generate"], stats["gen_tokens_per_s"]       # and time_experience, time_train, peak_gb_*

DeepSpeed-Chat's order: generate (at rlhf.temperature) -> the actor's and the reference's
log-probabilities (scored at the same temperature), the reward model's end scores and the
critic's values, without gradients: the experience, computed once -> rlhf.ppo_epochs passes
over its rlhf.ppo_mini_batches mini-batches, in order, each mini-batch one actor step (plus
the pre-training-mix step when rlhf.ptx_coef > 0, then the EMA actor) and one critic step.
With the defaults (1 epoch, 1 mini-batch) the policy ratio is exactly 1; from the second
update on the actor has moved away from the experience's log-probabilities and the policy
and value clips engage. The learning-rate schedule counts rollouts: every update of one
rollout runs at that step's rate.

Every model works on its own data-parallel slice of the global batch (`exchange`), and
every rank ends up with the whole batch's experience, so the models may have different
layouts. `generation` is the sampling seam (rollout.Generation): the engine calls it with
this rank's rows of the actor's slice and only reads the `phases` a Hybrid Engine reports.
Each step also times its three phases (generate, experience, train) and records their
peak memory, for ppo/metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from polytrain.config import RLHFConfig
from polytrain.distributed.world import max_over_world, mean_over_world
from polytrain.errors import ConfigError
from polytrain.rlhf import losses
from polytrain.rlhf.exchange import gather_objects, gather_rows, row_range
from polytrain.rlhf.experience import (
    Experience,
    actor_loss,
    critic_loss,
    make_experience,
    sampled_entropy,
    sequence_kl,
)
from polytrain.rlhf.roles import RoleModel
from polytrain.rlhf.rollout import Generation, Rollout, lay_out


class EMA:
    """An exponential moving average of a model's parameters (DeepSpeed-Chat's actor_ema), shard by shard."""

    def __init__(self, model: torch.nn.Module, beta: float):
        self.beta = beta
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """shadow = beta shadow + (1 - beta) parameter, after each actor step."""
        for name, p in model.named_parameters():
            self._local(self.shadow[name]).lerp_(self._local(p.detach()), 1 - self.beta)


def check_mini_batches(mini_batches: int, global_batch: int, trained_dp: dict[str, int]) -> None:
    """ConfigError unless rlhf.ppo_mini_batches cuts the global batch into equal mini-batches that split over
    the data-parallel ranks of every trained model (trained_dp: role name -> its dp degree)."""
    dp = math.lcm(*trained_dp.values())
    fits = [m for m in range(1, global_batch + 1) if global_batch % m == 0 and global_batch // m % dp == 0]
    if mini_batches in fits:
        return
    ranks = ", ".join(f"the {name}'s {d}" for name, d in trained_dp.items())
    raise ConfigError(f"rlhf.ppo_mini_batches = {mini_batches} must cut train.global_batch_size = {global_batch} "
                      f"into equal mini-batches that split over the data-parallel ranks ({ranks}); values that "
                      f"fit: {', '.join(map(str, fits))}")


class PPOEngine:
    """Step 3's models and one training step over them (module docstring)."""

    def __init__(self, actor: RoleModel, reference: RoleModel, reward: RoleModel, critic: RoleModel | None,
                 settings: RLHFConfig, generation: Generation, pad_id: int,
                 ptx: Callable[[int], float] | None = None):
        if (settings.algorithm == "ppo") != (critic is not None):
            raise ValueError("PPO needs a critic; GRPO has none")
        self.actor, self.reference, self.reward, self.critic = actor, reference, reward, critic
        self.settings, self.generation, self.pad_id = settings, generation, pad_id
        self.ptx = ptx
        """ptx(step) -> the pre-training-mix loss of its next mini-batch: backward through the actor (scaled by
        ptx_coef), not stepped."""
        self.ema = EMA(actor.model, settings.ema_beta) if settings.ema else None
        check_mini_batches(settings.ppo_mini_batches, actor.batch.global_batch_size,
                           {role.name: role.batch.dp for role in (actor, critic) if role is not None})

    # ----- the rollout and the no-grad pass ------------------------------------------

    def rollout(self, prompts: Sequence[list[int]], sample_ids: Sequence[int], step: int | str) -> Rollout:
        """Sample responses to the global batch's prompts (this rank generates its slice), laid out whole."""
        mine = row_range(len(prompts), self.actor.runtime)
        responses = self.generation([prompts[i] for i in mine], [sample_ids[i] for i in mine], step)
        everyone = gather_objects(responses, self.actor.runtime)
        return lay_out(prompts, everyone, self.pad_id).to(self.actor.runtime.device)

    @torch.no_grad()
    def _whole_batch(self, role: RoleModel, ids: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """fn on `role`'s slice of ids (B, T), micro-batch by micro-batch, gathered to (B, ...) on every rank."""
        role.model.eval()
        mine = row_range(ids.shape[0], role.runtime)
        mbs = role.batch.micro_batch_size
        with role.resident():  # an offloaded frozen model comes to the device for its pass only
            parts = [fn(ids[i:min(i + mbs, mine.stop)]) for i in range(mine.start, mine.stop, mbs)]
        return gather_rows(torch.cat(parts), role.runtime).to(self.actor.runtime.device)

    def scores(self, rollout: Rollout) -> torch.Tensor:
        """The reward model's end score of each sequence (B,), unclipped."""
        return losses.end_scores(self._whole_batch(self.reward, rollout.ids, self.reward.values), rollout.lengths)

    def experience(self, rollout: Rollout) -> Experience:
        """Log-probabilities, scores, values and advantages of a rollout."""
        ids = rollout.ids
        # Both at the sampling temperature, as the actor's new log-probabilities in update_actor.
        old = self._whole_batch(self.actor, ids, lambda x: self.actor.logprobs(x, self.settings.temperature))
        ref = self._whole_batch(self.reference, ids, lambda x: self.reference.logprobs(x, self.settings.temperature))
        scores = self.scores(rollout)
        values = self._whole_batch(self.critic, ids, self.critic.values)[:, :-1] if self.critic else None
        return make_experience(rollout, old, ref, scores, values, self.settings)

    # ----- the updates ---------------------------------------------------------------

    def _backward(self, role: RoleModel, exp: Experience, count: torch.Tensor,
                  loss_of: Callable[[Experience, torch.Tensor], tuple[torch.Tensor, dict]]) -> dict[str, torch.Tensor]:
        """Backward `loss_of(micro-batch experience, count)` over this rank's rows of `exp` (one mini-batch);
        this rank's share of each stat, on the device. count: the mini-batch's response tokens / dp (0-dim)."""
        role.model.train()
        mine = row_range(exp.mask.shape[0], role.runtime)
        mbs = role.batch.micro_batch_size
        starts = range(mine.start, mine.stop, mbs)
        sums: dict[str, torch.Tensor] = {}
        for k, i in enumerate(starts):
            role.before_micro_batch(last=k == len(starts) - 1)
            loss, stats = loss_of(exp.rows(slice(i, min(i + mbs, mine.stop))), count)
            role.backward(loss)
            for key, value in stats.items():
                sums[key] = sums.get(key, 0) + value.detach()
        return sums

    def update_actor(self, exp: Experience, count: torch.Tensor, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        """One actor step on a mini-batch's experience (then the ptx step and the EMA): (this rank's shares of
        policy_loss, clip_frac (, kl_loss); grad_norm, lr (, ptx_loss))."""
        temperature = self.settings.temperature

        def loss_of(part: Experience, count: torch.Tensor):
            new_logprobs = self.actor.logprobs(part.rollout.ids, temperature)
            return actor_loss(new_logprobs, part, self.settings, count)

        shares = self._backward(self.actor, exp, count / self.actor.runtime.dp_size, loss_of)
        after = self.actor.step(step)
        if self.ptx is not None:
            after["ptx_loss"] = self.ptx(step)
            self.actor.step(step)
        if self.ema is not None:
            self.ema.update(self.actor.model)
        return shares, after

    def update_critic(self, exp: Experience, count: torch.Tensor, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        """One critic step (PPO) on a mini-batch's experience: (this rank's share of value_loss; critic_grad_norm)."""
        def loss_of(part: Experience, count: torch.Tensor):
            loss = critic_loss(self.critic.values(part.rollout.ids)[:, :-1], part, self.settings, count)
            return loss, {"value_loss": loss}

        shares = self._backward(self.critic, exp, count / self.critic.runtime.dp_size, loss_of)
        return shares, {"critic_grad_norm": self.critic.step(step)["grad_norm"]}

    def train(self, exp: Experience, step: int) -> dict[str, float]:
        """rlhf.ppo_epochs passes over the experience's rlhf.ppo_mini_batches mini-batches, in order (as
        DeepSpeed-Chat: no shuffle, so every rank agrees with no seed); each mini-batch one actor step and one
        critic step. The experience is fixed, so from the second update on the ratio departs from 1. Returns
        the updates' mean losses, clip fraction and grad norms (the same on every rank), and the rate."""
        s = self.settings
        B = exp.mask.shape[0]
        size = B // s.ppo_mini_batches
        minis = [slice(i, i + size) for i in range(0, B, size)]
        # (M,) response tokens per mini-batch, kept on the device: each loss divides by its own, no host sync.
        counts = exp.mask.reshape(len(minis), size, -1).sum((1, 2)).float()
        shares: dict[str, torch.Tensor] = {}
        after: dict[str, list] = {}
        updates = [self.update_actor] + ([self.update_critic] if self.critic is not None else [])
        for _ in range(s.ppo_epochs):
            for rows, count in zip(minis, counts):
                for update in updates:
                    part_shares, part_after = update(exp.rows(rows), count, step)
                    for key, value in part_shares.items():
                        shares[key] = shares.get(key, 0) + value
                    for key, value in part_after.items():
                        after.setdefault(key, []).append(value)
        n = s.ppo_epochs * len(minis)
        stats = {key: mean_over_world(value / n).item() for key, value in shares.items()}
        stats.update({key: _mean(values) for key, values in after.items() if key != "lr"})
        stats["lr"] = after["lr"][-1]  # one rate per rollout: the schedule counts rollouts
        return stats

    @contextlib.contextmanager
    def _phase(self, name: str, stats: dict[str, Any]) -> Iterator[None]:
        """stats[time_<name>]: this rank's seconds in the block; stats[peak_gb_<name>]: the largest rank's
        peak memory in it (the accelerator's allocator, on a CPU the resident set)."""
        acc = self.actor.runtime.acc
        acc.synchronize()
        acc.reset_peak_memory()
        start = time.perf_counter()
        yield
        acc.synchronize()
        stats[f"time_{name}"] = time.perf_counter() - start
        peak = acc.memory_stats()["peak_gb"]
        if name == "generate":  # the hybrid engine restarts the peak after its gather
            peak = max([peak] + [p["peak_gb"] for p in getattr(self.generation, "phases", {}).values()])
        stats[f"peak_gb_{name}"] = max_over_world(torch.tensor([peak], device=self.actor.runtime.device)).item()

    def step(self, prompts: Sequence[list[int]], sample_ids: Sequence[int], step: int
             ) -> tuple[dict[str, Any], Experience]:
        """One step of step 3 on the global batch (every rank passes the same prompts); its metrics and experience:
        the losses and scores, and time_{generate,experience,train}, peak_gb_* and gen_tokens_per_s."""
        timing: dict[str, Any] = {}
        with self._phase("generate", timing):
            rollout = self.rollout(prompts, sample_ids, step)
        with self._phase("experience", timing):
            exp = self.experience(rollout)
        stats = {"reward": exp.scores.mean().item(), "kl": sequence_kl(exp).mean().item(),
                 "entropy": sampled_entropy(exp).item(),
                 "response_len": rollout.response_lens.float().mean().item()}
        with self._phase("train", timing):
            stats.update(self.train(exp, step))
        timing["gen_tokens_per_s"] = rollout.response_lens.sum().item() / max(timing["time_generate"], 1e-9)
        return {**stats, **timing}, exp


def _mean(values: list) -> float | None:
    """The mean of the updates' values; a grad norm is None for an fp16 step skipped on overflow (None if all were)."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None

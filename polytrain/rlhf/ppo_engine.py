"""One step of step 3 on one world: a rollout, one no-grad pass of the four models, an actor and a critic step.

    engine = PPOEngine(actor, reference, reward, critic, cfg.rlhf, generation, pad_id)
    stats, exp = engine.step(prompts, sample_ids, step)     # the global batch's prompts, every rank
    stats["time_generate"], stats["gen_tokens_per_s"]       # and time_experience, time_train, peak_gb_*

DeepSpeed-Chat's order, strictly on-policy (generation batch = training batch, one PPO
epoch): generate -> the actor's and the reference's log-probabilities, the reward model's
end scores and the critic's values, without gradients -> one actor step (plus the
pre-training-mix step when rlhf.ptx_coef > 0) -> one critic step -> the EMA actor.

Every model works on its own data-parallel slice of the global batch (`exchange`), and
every rank ends up with the whole batch's experience, so the models may have different
layouts. `generation` is the sampling seam (rollout.Generation): the engine calls it with
this rank's rows of the actor's slice and only reads the `phases` a Hybrid Engine reports.
Each step also times its three phases (generate, experience, train) and records their
peak memory, for ppo/metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from polytrain.config import RLHFConfig
from polytrain.distributed.world import max_over_world, mean_over_world
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
        """ptx(step) -> the pre-training-mix loss: backward through the actor (scaled by ptx_coef), not stepped."""
        self.ema = EMA(actor.model, settings.ema_beta) if settings.ema else None

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
        old = self._whole_batch(self.actor, ids, self.actor.logprobs)
        ref = self._whole_batch(self.reference, ids, self.reference.logprobs)
        scores = self.scores(rollout)
        values = self._whole_batch(self.critic, ids, self.critic.values)[:, :-1] if self.critic else None
        return make_experience(rollout, old, ref, scores, values, self.settings)

    # ----- the updates ---------------------------------------------------------------

    def _train(self, role: RoleModel, exp: Experience, loss_of: Callable[[Experience, float], tuple[torch.Tensor, dict]],
               ) -> dict[str, float]:
        """Backward `loss_of(micro-batch experience, count)` over this rank's rows; the batch's stats (every rank)."""
        role.model.train()
        count = exp.mask.sum().item() / role.runtime.dp_size  # the ranks' shares add up to the global mean
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
        return {key: mean_over_world(value).item() for key, value in sums.items()}

    def train_actor(self, exp: Experience, step: int) -> dict[str, float]:
        """One actor step on the experience (and the ptx step); its losses, clip fraction, grad norm."""
        def loss_of(part: Experience, count: float):
            return actor_loss(self.actor.logprobs(part.rollout.ids), part, self.settings, count)

        stats = self._train(self.actor, exp, loss_of)
        stats.update(self.actor.step(step))
        if self.ptx is not None:
            stats["ptx_loss"] = self.ptx(step)
            self.actor.step(step)
        if self.ema is not None:
            self.ema.update(self.actor.model)
        return stats

    def train_critic(self, exp: Experience, step: int) -> dict[str, float]:
        """One critic step (PPO): the clipped value loss and the critic's grad norm."""
        def loss_of(part: Experience, count: float):
            loss = critic_loss(self.critic.values(part.rollout.ids)[:, :-1], part, self.settings, count)
            return loss, {"value_loss": loss}

        stats = self._train(self.critic, exp, loss_of)
        return {"value_loss": stats["value_loss"], "critic_grad_norm": self.critic.step(step)["grad_norm"]}

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
            stats.update(self.train_actor(exp, step))
            if self.critic is not None:
                stats.update(self.train_critic(exp, step))
        timing["gen_tokens_per_s"] = rollout.response_lens.sum().item() / max(timing["time_generate"], 1e-9)
        return {**stats, **timing}, exp

"""The models of the three steps, each with its own layout on the one world of the job.

    layout = role_layout(cfg, "critic")                      # the rlhf.critic_* keys, resolved
    role = build_role(acc, world, role_config(cfg, "critic", model, lr, steps), "critic", start)
    role.values(ids) / role.logprobs(ids) / role.lm_loss(inputs, targets)
    role.backward(loss); role.step(i)                         # trained roles: clip, schedule, step

| role      | trained in | keys                                     | unset (-1, 0, "") means         |
| --------- | ---------- | ---------------------------------------- | ------------------------------- |
| actor     | steps 1, 3 | rlhf.actor_{zero,tp,offload,precision}     | parallel.zero, tp, offload; train.precision |
| reference | frozen     | rlhf.reference_{zero,tp,precision}         | the actor's                     |
| reward    | step 2     | rlhf.reward_{zero,tp,offload,precision}    | parallel.zero, tp, offload; train.precision |
| critic    | step 3     | rlhf.critic_{zero,tp,offload,precision}    | the reward model's              |

A frozen model (the reference, and the reward model in step 3) has no gradients or
optimizer state: ZeRO-3 shards its parameters, stages 0-2 replicate them, nothing is
offloaded. Each role is an ordinary polytrain model built by `build_model` on its own
`Runtime` over the same processes (data parallelism takes what tp leaves of the world);
every other [parallel] key (zero_shard, reduce_bucket_mb, nvme_path, sp) and [train] key
(batch sizes, optimizer, clipping, warmup) is shared by all roles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from polytrain.backend.base import Accelerator
from polytrain.checkpoint import load_in_place
from polytrain.config import Config, ModelConfig
from polytrain.distributed.runtime import Runtime
from polytrain.distributed.world import World, max_over_world
from polytrain.errors import ConfigError, TrainingDiverged
from polytrain.optim.schedule import set_lr
from polytrain.rlhf import losses
from polytrain.rlhf.batches import IGNORE
from polytrain.rlhf.offload import IdleOffload
from polytrain.rlhf.sources import Start
from polytrain.train.build import AUTOCAST, BuiltModel, build_model
from polytrain.train.precision import LossScaler, check_fp16_autocast
from polytrain.train.startup import Layout, plan_layout

ROLES = ("actor", "reference", "reward", "critic")
FROZEN_IN_STEP3 = ("reference", "reward")


@dataclass(frozen=True)
class RoleLayout:
    """One model's ZeRO stage, tensor-parallel degree, offload and compute precision."""

    zero: int
    tp: int
    offload: str
    precision: str


def _pick(value: Any, unset: Any, fallback: Any) -> Any:
    return fallback if value == unset else value


def role_layout(cfg: Config, role: str, frozen: bool = False) -> RoleLayout:
    """The layout of `role` from its rlhf.<role>_* keys (module docstring); `frozen`: used without training."""
    r, p, t = cfg.rlhf, cfg.parallel, cfg.train
    actor = RoleLayout(_pick(r.actor_zero, -1, p.zero), _pick(r.actor_tp, 0, p.tp),
                       _pick(r.actor_offload, "", p.offload), _pick(r.actor_precision, "", t.precision))
    reward = RoleLayout(_pick(r.reward_zero, -1, p.zero), _pick(r.reward_tp, 0, p.tp),
                        _pick(r.reward_offload, "", p.offload), _pick(r.reward_precision, "", t.precision))
    layouts = {
        "actor": actor, "reward": reward,
        "reference": RoleLayout(_pick(r.reference_zero, -1, actor.zero), _pick(r.reference_tp, 0, actor.tp),
                                "none", _pick(r.reference_precision, "", actor.precision)),
        "critic": RoleLayout(_pick(r.critic_zero, -1, reward.zero), _pick(r.critic_tp, 0, reward.tp),
                             _pick(r.critic_offload, "", reward.offload), _pick(r.critic_precision, "", reward.precision)),
    }
    layout = layouts[role]
    if frozen:  # nothing to shard but the parameters, nothing to offload
        return dataclasses.replace(layout, zero=3 if layout.zero == 3 else 0, offload="none")
    if layout.offload != "none" and layout.zero not in (1, 2):
        raise ConfigError(f"rlhf.{role}_offload = '{layout.offload}' moves ZeRO-1/2's optimizer state; the {role} "
                          f"runs at ZeRO stage {layout.zero} (rlhf.{role}_zero / parallel.zero): set it to 1 or 2, "
                          f"or the offload to 'none'")
    return layout


def role_config(cfg: Config, role: str, model: ModelConfig, *, lr: float, steps: int,
                frozen: bool = False) -> Config:
    """The config one role is built and trained with: its model, its layout, its learning rate and run length."""
    layout = role_layout(cfg, role, frozen)
    if cfg.parallel.pp > 1 or cfg.parallel.tp_mode != "1d":
        raise ConfigError("polytrain rlhf runs with parallel.pp = 1 and parallel.tp_mode = '1d' (step 3 generates "
                          "through the actor with a KV cache); use parallel.dp, zero and tp")
    parallel = dataclasses.replace(cfg.parallel, zero=layout.zero, tp=layout.tp, offload=layout.offload, dp=-1,
                                   sp=cfg.parallel.sp and layout.tp > 1)
    scale = lr / cfg.train.lr  # the schedule keeps its shape: min_lr in the same proportion
    train = dataclasses.replace(cfg.train, lr=lr, min_lr=cfg.train.min_lr * scale, precision=layout.precision)
    return dataclasses.replace(cfg, model=model, parallel=parallel, train=train,
                               run=dataclasses.replace(cfg.run, steps=steps))


class RoleModel:
    """One built model of a step, on its own runtime, with what runs and trains it."""

    def __init__(self, name: str, cfg: Config, runtime: Runtime, layout: Layout, built: BuiltModel,
                 trained: bool):
        self.name, self.cfg, self.runtime, self.layout, self.built = name, cfg, runtime, layout, built
        self.dtype = AUTOCAST[cfg.train.precision]
        self.optimizer = built.dp.build_optimizer(built.model, cfg.train) if trained else None
        self.scaler = None
        if trained and cfg.train.precision == "fp16":
            check_fp16_autocast(runtime.acc)
            t = cfg.train
            self.scaler = LossScaler(loss_scale=t.loss_scale, initial_scale_power=t.initial_scale_power,
                                     loss_scale_window=t.loss_scale_window, hysteresis=t.hysteresis,
                                     min_loss_scale=t.min_loss_scale, device=runtime.device)
        if not trained:
            for p in built.model.parameters():
                p.requires_grad_(False)
            built.model.eval()
        tp = built.tp_ctx
        self._logprobs = tp.logprob_fn(cfg.model.vocab_size) if tp is not None else losses.token_logprobs
        # Under sequence parallelism a forward's length must divide by tp; rows are right-padded to it.
        self._multiple = runtime.dims.tp if runtime.dims.sp else 1
        self.idle: IdleOffload | None = None  # set by offload_when_idle

    def offload_when_idle(self, copies: bool | None = None) -> None:
        """Keep this frozen model in host memory except inside `resident()` (rlhf.offload_*; `copies`: IdleOffload's)."""
        self.idle = IdleOffload(self.model, self.runtime, copies)

    def resident(self) -> contextlib.AbstractContextManager:
        """The model on the device for the block (always, unless offload_when_idle was called)."""
        return self.idle.resident() if self.idle is not None else contextlib.nullcontext()

    @property
    def model(self) -> nn.Module:
        return self.built.model

    @property
    def batch(self):
        """This role's BatchPlan (micro-batch size, dp) for the shared global batch."""
        return self.layout.batch

    def autocast(self):
        return self.runtime.acc.autocast(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """model(ids) for ids (B, T) on this rank's device: logits (B, T, V or V/tp) or values (B, T)."""
        ids = ids.to(self.runtime.device)
        T = ids.shape[1]
        pad = -T % self._multiple
        if pad:  # right padding changes nothing before it (causal attention)
            ids = torch.cat([ids, ids.new_zeros(ids.shape[0], pad)], 1)
        with self.autocast():
            return self.model(ids)[:, :T]

    def logprobs(self, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log p(ids[:, t + 1] | ids[:, :t + 1]) (B, T - 1) under softmax(logits / temperature) (step 3 scores at
        the sampling temperature), fp32, vocabulary-parallel under tp."""
        targets = ids[:, 1:].to(self.runtime.device)
        return losses.tempered_logprobs(self.forward(ids[:, :-1]), targets, temperature, self._logprobs)

    def values(self, ids: torch.Tensor) -> torch.Tensor:
        """A value model's (B, T) values, fp32."""
        return self.forward(ids).float()

    def lm_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss over the scored targets (B, T) (-100 = not scored), through the built loss."""
        inputs, targets = inputs.to(self.runtime.device), targets.to(self.runtime.device)
        pad = -inputs.shape[1] % self._multiple
        if pad:
            inputs = torch.cat([inputs, inputs.new_zeros(inputs.shape[0], pad)], 1)
            targets = torch.cat([targets, targets.new_full((targets.shape[0], pad), IGNORE)], 1)
        with self.autocast():
            return self.built.loss(self.model, [inputs], targets)

    def before_micro_batch(self, last: bool) -> None:
        self.built.dp.before_micro_batch(self.model, last)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale_loss(loss) if self.scaler else loss).backward()

    def step(self, index: int) -> dict[str, float | None]:
        """Clip by the global norm, set the scheduled rate of step `index` (0-based), step, zero the gradients."""
        dp = self.built.dp
        if self.scaler is not None and self.scaler.unscale_and_check(dp.gradients(), max_over_world):
            dp.zero_grad()
            self.scaler.update(found_inf=True)  # an fp16 overflow on any rank skips the step everywhere
            return {"grad_norm": None, "lr": self.optimizer.param_groups[0]["lr"]}
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else math.inf
        norm = dp.clip_grad_norm_(clip)
        if not math.isfinite(norm):
            dp.zero_grad()
            raise TrainingDiverged(f"the {self.name}'s gradient norm is {norm} at step {index + 1}; the step was "
                                   f"not applied; lower its learning rate (now {self.cfg.train.lr}) and rerun to resume")
        lr = set_lr(self.optimizer, index, self.cfg)
        dp.step()
        dp.zero_grad()
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        return {"grad_norm": norm, "lr": lr}

    def close(self) -> None:
        self.built.dp.close()


def build_role(acc: Accelerator, world: World, cfg: Config, name: str, start: Start | None = None,
               trained: bool = True, run_dir: Path | None = None) -> RoleModel:
    """`cfg` (a role_config) checked on the world, built through build_model on its own runtime, with
    `start`'s checkpoint loaded (by name, at any layout) when it has one."""
    layout = plan_layout(cfg, world.world_size)
    runtime = Runtime.create(acc, world, layout.dims)
    built = build_model(runtime, cfg, None, run_dir)
    if start is not None and start.checkpoint is not None:
        load_weights(built.model, start.checkpoint, start.skip)
    return RoleModel(name, cfg, runtime, layout, built, trained)


def load_weights(model: nn.Module, checkpoint: Path, skip: tuple[str, ...] = ()) -> None:
    """A checkpoint's model tensors into `model` (any layout: DCP reshards by name), except `skip`,
    which keep their name-seeded values."""
    state = {k: v for k, v in get_model_state_dict(model).items() if k not in skip}
    load_in_place({"model": state}, checkpoint)
    set_model_state_dict(model, state, options=StateDictOptions(strict=not skip))


def rng_state(acc: Accelerator) -> dict[str, Any]:
    """The random states a checkpoint keeps (dropout draws from them)."""
    return {"torch": torch.get_rng_state(), "device": acc.get_rng_state(), "python": random.getstate()}


def set_rng_state(acc: Accelerator, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["device"] is not None:
        acc.set_rng_state(state["device"])
    random.setstate(state["python"])

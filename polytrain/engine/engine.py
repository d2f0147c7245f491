"""The engine `polytrain.initialize` returns: DeepSpeed's training-loop API over polytrain's strategies.

    for step in range(steps):
        for micro_batch in ...:                  # gradient_accumulation_steps of them
            loss = engine(micro_batch)           # forward, under the config's autocast
            engine.backward(loss)                # scaled by 1 / accumulation steps (and the fp16 scale)
            engine.step()                        # the optimizer steps only at accumulation boundaries

The engine counts micro-batches itself, as DeepSpeed does, so it knows the last micro-batch of
an optimizer step before that micro-batch's forward and tells the data-parallel strategy then
(which is when ZeRO-1 and replicated data parallelism decide whether to reduce gradients).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from polytrain.backend.base import Accelerator
from polytrain.deepspeed import DSConfig
from polytrain.distributed.data_parallel import DataParallel
from polytrain.distributed.world import World, max_over_world
from polytrain.engine import checkpoint
from polytrain.errors import PolytrainError, TrainingDiverged
from polytrain.optim.builder import restart_state
from polytrain.train.precision import LossScaler

# DeepSpeed's default for steps_per_print.
STEPS_PER_PRINT = 10
_AUTOCAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class EngineUsageError(PolytrainError, RuntimeError):
    """An engine method called out of order, e.g. step() before backward()."""


class Engine(nn.Module):
    """Forward, backward and optimizer steps of one data-parallel rank; see the module docstring.

    Built by `polytrain.initialize`. `module` is the user's model (laid out by the strategy:
    FSDP-sharded under ZeRO-3, replicated otherwise).
    """

    def __init__(self, *, module: nn.Module, ds: DSConfig, dp: DataParallel, acc: Accelerator,
                 world: World, device: torch.device, optimizer: torch.optim.Optimizer | None,
                 lr_scheduler: Any, training_dataloader: DataLoader | None):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.device = device
        self.global_rank, self.local_rank = world.rank, world.local_rank
        self.world_size = self.dp_world_size = ds.world_size
        self.global_steps = 0
        """Optimizer steps taken, including steps skipped for fp16 overflow (as DeepSpeed counts)."""
        self.global_samples = 0
        self.micro_steps = 0
        self._ds, self._dp, self._acc = ds, dp, acc
        self._autocast = _AUTOCAST[ds.precision]
        self._scaler = LossScaler(**asdict(ds.fp16), device=device) if ds.fp16 else None
        self._steps_per_print = ds.steps_per_print or STEPS_PER_PRINT
        self._announced = -1  # the micro-step the strategy was last told about
        self._backward_done = False  # backward ran since the last step()
        self._window_loss = torch.zeros((), device=device)  # this optimizer step's mean loss so far
        self._grad_norm: float | None = None
        self._step_applied = False
        self._optimizer_fresh = True  # no update applied and no optimizer state loaded yet

    # ----- batch sizes (DeepSpeed's derivation, see polytrain.deepspeed.config) -------

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self._ds.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._ds.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._ds.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its optimizer step (its step() updates)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    # ----- forward / backward / step ------------------------------------------------

    def _announce(self) -> None:
        """Tell the strategy, once per micro-batch, whether this is the last one of the step."""
        if self._announced != self.micro_steps:
            self._dp.before_micro_batch(self.module, last=self.is_gradient_accumulation_boundary())
            self._announced = self.micro_steps

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward under the config's autocast (bf16 / fp16; none for fp32)."""
        if torch.is_grad_enabled():
            self._announce()
        with self._acc.autocast(self._autocast):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Accumulate this micro-batch's gradients of `loss`, divided by the accumulation steps.

        Dividing every micro-batch's mean loss by their number makes the accumulated gradient
        the gradient of the whole step's mean loss. Returns `loss`.
        """
        if not loss.requires_grad:
            raise EngineUsageError("engine.backward(loss): the loss has no gradient; compute it "
                                   "from engine(...) outputs with gradients enabled")
        self._announce()
        scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        self._window_loss += loss.detach().float() / self.gradient_accumulation_steps()
        if self._scaler is not None:
            scaled = self._scaler.scale_loss(scaled)
        scaled.backward(retain_graph=retain_graph)
        self._backward_done = True
        return loss

    def step(self) -> None:
        """End the micro-batch; at an accumulation boundary, also take the optimizer step.

        The step: (fp16) unscale and skip the step on overflow, clip to `gradient_clipping`
        by the global norm, optimizer step, zero the gradients, advance the lr scheduler.
        """
        if not self._backward_done:
            raise EngineUsageError("engine.step() before engine.backward(loss): run backward on "
                                   "this micro-batch's loss first")
        self._backward_done = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if self.optimizer is None:
            raise EngineUsageError("engine.step() without an optimizer: add an optimizer block to "
                                   "the DeepSpeed config or pass optimizer= to polytrain.initialize")
        self._step_applied = self._optimizer_step()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        if self.global_steps % self._steps_per_print == 0 and self.global_rank == 0:
            print(self._step_line(), flush=True)
        self._window_loss.zero_()

    def _optimizer_step(self) -> bool:
        """Unscale, clip, step; False when an fp16 overflow skipped the step."""
        # An fp16 overflow on any rank skips the step on every rank, as the trainer does.
        scaler = self._scaler
        if scaler is not None and scaler.unscale_and_check(self._dp.gradients(), max_over_world):
            self._dp.zero_grad()
            self._scaler.update(found_inf=True)
            self._grad_norm = None
            return False
        self._grad_norm = self._dp.clip_grad_norm_(self._ds.gradient_clipping or math.inf)
        if not math.isfinite(self._grad_norm):
            self._dp.zero_grad()
            raise TrainingDiverged(
                f"gradient norm is {self._grad_norm} at step {self.global_steps + 1}; the step was not "
                f"applied; lower the learning rate or lengthen the warmup")
        self._dp.step()
        self._dp.zero_grad()
        self._optimizer_fresh = False
        if self._scaler is not None:
            self._scaler.update(found_inf=False)  # after unscaling: a clean step may grow the scale
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return True

    def _step_line(self) -> str:
        norm = "skipped" if self._grad_norm is None else f"{self._grad_norm:.3f}"
        line = (f"step {self.global_steps} | loss {self._window_loss.item():.4f} (rank 0) | "
                f"lr {self.get_lr()[0]:.3e} | grad norm {norm}")
        if self._scaler is not None:
            line += f" | loss scale {self._scaler.scale:g} | skipped {self.skipped_steps}"
        return line

    def zero_grad(self) -> None:
        """Drop accumulated gradients (step() already does this after each optimizer step)."""
        self._dp.zero_grad()

    def destroy(self) -> None:
        """Release what would outlive training (nvme offload's files); the engine is unusable after."""
        self._dp.close()

    # ----- what happened ------------------------------------------------------------

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return self._scaler.skipped_steps if self._scaler is not None else 0

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1 without fp16)."""
        return self._scaler.scale if self._scaler is not None else 1.0

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the weights (False after an fp16 overflow)."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group: the one the next optimizer step uses."""
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer else []

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step, before clipping; None before the
        first step and after a step skipped for fp16 overflow."""
        return self._grad_norm

    # ----- checkpoints --------------------------------------------------------------

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True) -> Path:
        """Save model, optimizer, scheduler and counters to `save_dir/<tag>`; every rank must call it.

        `tag` defaults to "global_step<N>"; with `save_latest` the `latest` file then names it.
        `client_state` (any picklable dict) comes back from `load_checkpoint`.
        """
        if self.optimizer is None:
            raise EngineUsageError("save_checkpoint needs an optimizer; the engine has none")
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        if not tag or "/" in tag or tag.startswith("."):
            raise EngineUsageError(f"checkpoint tag {tag!r} must be a plain directory name")
        state = {
            "global_steps": self.global_steps, "global_samples": self.global_samples,
            "dp_world_size": self.dp_world_size,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self._scaler.state_dict() if self._scaler is not None else None,
        }
        return checkpoint.save(save_dir, tag, self._dp, state, client_state or {}, save_latest)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
        """Load `load_dir/<tag>` (the tag `latest` names when None); returns (its path, client_state).

        Returns (None, None), as DeepSpeed does, when `tag` is None and there is no `latest`
        file. `load_module_only` restores the weights alone: no optimizer state, scheduler or
        step counters.
        """
        if self.optimizer is None:
            raise EngineUsageError("load_checkpoint needs an optimizer; the engine has none")
        if tag is None:
            tag = checkpoint.read_latest(load_dir)
            if tag is None:
                if self.global_rank == 0:
                    print(f"no 'latest' file in {load_dir}; nothing loaded (pass tag= to pick one)",
                          flush=True)
                return None, None
        path = Path(load_dir) / tag
        optimizer_states = load_optimizer_states and not load_module_only
        state, client_state = checkpoint.load(path, self._dp, optimizer_states)
        if optimizer_states:
            self._optimizer_fresh = False
        elif self._optimizer_fresh:  # loading made state at step 1; the first update must be Adam's t = 1
            restart_state(self.optimizer)
        if not load_module_only:
            self.global_steps, self.global_samples = state["global_steps"], state["global_samples"]
            self.micro_steps = self.global_steps * self.gradient_accumulation_steps()
            if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"]:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            if load_optimizer_states and self._scaler is not None and state["loss_scaler"]:
                self._scaler.load_state_dict(state["loss_scaler"])
        return str(path), client_state

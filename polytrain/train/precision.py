"""fp16 loss scaling with DeepSpeed's semantics, on any device and any gradient layout.

fp16 has 5 exponent bits, so small gradients flush to zero. Multiplying the loss by a large
scale lifts them into range; the gradients are divided by it again before the optimizer sees
them. Too large a scale overflows instead: that step is skipped and the scale lowered.

The constructor's arguments are DeepSpeed's `fp16` config keys, so its block maps 1:1:

    fp16 = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
            "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}
    scaler = LossScaler(**fp16)

One optimizer step (gradient accumulation scales every micro-batch by the same scale):

    for batch in micro_batches:
        scaler.scale_loss(loss(batch)).backward()
    grads = [p.grad for p in model.parameters()]
    overflow = scaler.unscale_and_check(grads, reduce_found_inf=max_over_ranks)
    if not overflow:
        clip_grad_norm_(model.parameters(), clip)   # on the true, unscaled gradients
        optimizer.step()
    optimizer.zero_grad()
    scaler.update(overflow)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from polytrain.backend.base import Accelerator
from polytrain.errors import ConfigError, TrainingDiverged


class LossScaler:
    """Static or dynamic loss scale, with DeepSpeed's update rule.

    Dynamic (`loss_scale` = 0), after each step's `update(found_inf)`:

    - a clean step extends the run of clean steps; when the run reaches `loss_scale_window`
      the scale doubles, the run restarts at 0 and the hysteresis counter refills to
      `hysteresis`;
    - an overflowing step is skipped and ends the run of clean steps. If the hysteresis
      counter is above 1 it is decremented and the scale kept; at 1 the scale is halved
      (never below `min_loss_scale`) and the counter stays at 1.

    So with `hysteresis` = 2 the first overflow keeps the scale and every later one halves it
    until the next growth refills the counter. With `consecutive_hysteresis` every clean step
    refills it, so only `hysteresis` overflows in a row lower the scale. An overflow when the
    scale is already `min_loss_scale` raises `TrainingDiverged` (`raise_error_at_min_scale`):
    every later step would be skipped too.

    Static (`loss_scale` > 0): the scale never changes, but an overflowing step is still
    skipped and counted, since applying inf/NaN gradients would destroy the weights.

    `device` holds the overflow flag handed to the collective: the device the process group
    communicates on (this rank's accelerator).
    """

    def __init__(self, loss_scale: float = 0.0, initial_scale_power: int = 16,
                 loss_scale_window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_loss_scale: float = 1.0,
                 raise_error_at_min_scale: bool = True, device: torch.device | str = "cpu"):
        if loss_scale < 0:
            raise ValueError(f"loss_scale = {loss_scale}; use 0 (dynamic) or a positive scale")
        if loss_scale_window < 1 or hysteresis < 1:
            raise ValueError(f"loss_scale_window = {loss_scale_window} and hysteresis = "
                             f"{hysteresis} must both be at least 1")
        if min_loss_scale <= 0:
            raise ValueError(f"min_loss_scale = {min_loss_scale} must be positive")
        self.dynamic = loss_scale == 0
        self.loss_scale_window = loss_scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_loss_scale = float(min_loss_scale)
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.device = torch.device(device)
        self._scale = float(2 ** initial_scale_power if self.dynamic else loss_scale)
        self._clean_steps = 0  # clean steps since the last overflow or growth
        self._hysteresis_left = hysteresis
        self.skipped_steps = 0
        """Steps skipped for inf/NaN gradients since training began (kept in checkpoints)."""

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the scale; call `.backward()` on the result."""
        return loss * self._scale

    def unscale_and_check(
        self, grads: Iterable[torch.Tensor | None],
        reduce_found_inf: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> bool:
        """Divide `grads` in place by the scale; True if any gradient on any rank is inf/NaN.

        DTensor gradients (ZeRO / FSDP shards) are unscaled through their local shard, so each
        rank sees only its own shard's overflow: `reduce_found_inf` must combine the 1-element
        float tensor (on `device`, nonzero = overflow) over every rank holding other gradients
        (an all-reduce with MAX or SUM) and return it, so that all ranks skip the same steps.
        Every rank must call this each step, even one without gradients, for that collective.
        """
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_device.setdefault(local.device, []).append(local)
        found_inf = torch.zeros(1, device=self.device)
        # The fused kernel wants its flag and 1/scale on the gradients' device.
        for device, tensors in by_device.items():
            found_here = torch.zeros(1, device=device)
            inv_scale = torch.full((1,), 1.0 / self._scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_here, inv_scale)
            found_inf += found_here.to(self.device)
        if reduce_found_inf is not None:
            found_inf = reduce_found_inf(found_inf)
        return bool(found_inf.item())

    def update(self, found_inf: bool) -> None:
        """Record one optimizer step: skipped if `found_inf`, and adjust the scale (see class)."""
        if found_inf:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        if found_inf:
            self._clean_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
            elif self._scale <= self.min_loss_scale and self.raise_error_at_min_scale:
                raise TrainingDiverged(
                    f"fp16 gradients overflow even at the minimum loss scale "
                    f"{self.min_loss_scale:g}; lower the learning rate, or train in bf16 or fp32")
            else:
                self._scale = max(self._scale / 2, self.min_loss_scale)
            return
        self._clean_steps += 1
        grew = self._clean_steps == self.loss_scale_window
        if grew:
            self._scale *= 2
            self._clean_steps = 0
        if grew or self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """Everything `update` depends on, as plain Python numbers."""
        return {"scale": self._scale, "clean_steps": self._clean_steps,
                "hysteresis_left": self._hysteresis_left, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; a static scale comes from this run's settings instead,
        as other hyperparameters do."""
        if self.dynamic:
            self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])


def check_fp16_autocast(acc: Accelerator) -> None:
    """Raise a ConfigError naming train.precision unless `acc` can autocast to fp16."""
    supported = acc.autocast_dtypes()
    if torch.float16 in supported:
        return
    other = "bf16" if torch.bfloat16 in supported else "fp32"
    raise ConfigError(
        f"train.precision = fp16 needs fp16 autocast, which {acc.name} ({acc.device_name()}) "
        f"does not support with torch {torch.__version__}; set train.precision to {other}")

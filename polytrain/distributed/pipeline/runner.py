"""Run a training step or a validation pass through the pipeline schedule.

Every rank of a pipeline group calls `train_step` with the same micro-batches (its
data-parallel share of the step). The first stage reads the tokens, the last the
targets; the schedule moves activations forward and gradients back between the
ranks. Gradient accumulation matches the single-process loop exactly: each
micro-batch's loss is divided by the number of micro-batches of the step before its
backward (so the schedule's own scaling is off), and the data-parallel gradient
average then makes it the mean over the global batch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from polytrain.distributed.collectives import exchange
from polytrain.distributed.pipeline.plan import PipelinePlan
from polytrain.distributed.pipeline.stages import pipeline_stages

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleZBVZeroBubble,
}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineRunner:
    """This rank's stages and the schedule over them (see the module docstring)."""

    def __init__(self, plan: PipelinePlan, modules: nn.ModuleDict, pp_rank: int, group, device: torch.device,
                 micro_batch_size: int, seq_len: int, hidden_shape: tuple[int, ...],
                 logits_shape: tuple[int, ...], after_backward: Callable[[], None] | None = None,
                 activation_dtype: torch.dtype = torch.float32):
        self.plan, self.device, self.pp_rank, self.group = plan, device, pp_rank, group
        self.hidden_shape, self.activation_dtype = hidden_shape, activation_dtype
        self.after_backward = after_backward  # once per step, e.g. summing a tied weight's two gradients
        self.modules = {int(k): m for k, m in modules.items()}
        self.stage_ids = sorted(self.modules)
        self.has_first = 0 in self.stage_ids
        self.has_last = plan.num_stages - 1 in self.stage_ids
        self.stages = pipeline_stages(self.modules, plan, group, device, micro_batch_size, seq_len,
                                      hidden_shape, logits_shape, activation_dtype)  # by stage index
        cls = SCHEDULE_CLASSES[plan.schedule]
        # scale_grads=False: _stage_loss already divides by the step's micro-batch count,
        # which also stays right when a step takes several pipeline runs.
        self.schedule = cls(self.stages if plan.stages_per_rank > 1 else self.stages[0],
                            n_microbatches=plan.microbatches, loss_fn=self._stage_loss, scale_grads=False)
        self._loss: LossFn | None = None
        self._loss_weight = 1.0
        self._loss_scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._losses: list[torch.Tensor] = []

    def _stage_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss for one micro-batch: weighted for accumulation, scaled for fp16."""
        loss = self._loss(logits, targets) * self._loss_weight
        self._losses.append(loss.detach())
        return self._loss_scale(loss) if self._loss_scale is not None else loss

    def _runs(self, batches: list[list[int]], data):
        """(inputs, targets) of each pipeline run: `plan.microbatches` micro-batches stacked, (m x mbs, T)."""
        m = self.plan.microbatches
        for start in range(0, len(batches), m):
            indices = [i for batch in batches[start:start + m] for i in batch]
            inputs, targets = data.get_batch(indices)
            yield (inputs.to(self.device, non_blocking=True) if self.has_first else None,
                   targets.to(self.device, non_blocking=True) if self.has_last else None)

    def train_step(self, batches: list[list[int]], data, loss_fn: LossFn,
                   scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward over `batches` (this rank's micro-batches of the step).

        Returns the sum of the weighted micro-batch losses on ranks holding the last
        stage (this data-parallel rank's mean loss), zero elsewhere; see `mean_loss`.
        """
        self._loss, self._loss_weight, self._loss_scale = loss_fn, 1.0 / len(batches), scale_loss
        self._losses = []
        for inputs, targets in self._runs(batches, data):
            args = (inputs,) if inputs is not None else ()
            self.schedule.step(*args, target=targets, return_outputs=False)
        if self.after_backward is not None:
            self.after_backward()
        return self._local_sum()

    @torch.no_grad()
    def evaluate(self, batches: list[list[int]], data, loss_fn: LossFn) -> float:
        """Mean loss over `batches` of every data-parallel rank, forward only; the same value on all ranks.

        A plain forward pass, stage by stage, rather than the schedule's eval mode:
        torch's zero-bubble runtime cannot run its schedule without a backward, and
        this needs no switching of the stages between training and evaluation.
        Each rank runs its stages in increasing order, each over all micro-batches of a
        run: a stage fed by another rank first receives all its inputs as one batch, and
        one whose next stage is on another rank sends all its outputs as one batch, waited
        before the rank goes on. Stage s's transfer thus completes once stage s + 1's rank
        reaches it, which needs only stages before s, so no order of ranks can deadlock;
        and a rank never has a send and a receive with one peer outstanding apart
        (collectives.exchange). The ranks do not overlap micro-batches as GPipe would.
        """
        total = torch.zeros((), device=self.device)
        m, last = self.plan.microbatches, self.plan.num_stages - 1
        for inputs, targets in self._runs(batches, data):
            handed: list[torch.Tensor] = []  # the previous stage's outputs, when it ran on this rank
            for index in self.stage_ids:
                if index == 0:
                    xs = list(inputs.chunk(m))  # m x (mbs, T) tokens
                elif index - 1 in self.modules:
                    xs = handed
                else:  # m x (mbs, T, D) activations from the previous stage's rank
                    xs = [torch.empty(self.hidden_shape, dtype=self.activation_dtype, device=self.device)
                          for _ in range(m)]
                    exchange(recvs=[(x, self._peer(index - 1)) for x in xs], group=self.group).wait()
                ys = [self.modules[index](x) for x in xs]
                if index == last:
                    for y, t in zip(ys, targets.chunk(m)):
                        total += loss_fn(y, t).float()
                elif index + 1 in self.modules:
                    handed = ys
                else:
                    exchange(sends=[(y, self._peer(index + 1)) for y in ys], group=self.group).wait()
        # ZeRO-3 stages keep their parameters gathered after a forward (see
        # FSDP2DataParallel); without a backward to reshard them, free them here.
        for module in self.modules.values():
            for sub in module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()
        return self.mean_loss(total / max(1, len(batches)))

    def _peer(self, stage: int) -> int:
        """Global rank of the rank in this pipeline group that runs `stage`."""
        return dist.get_global_rank(self.group, self.plan.rank_of_stage(stage))

    def _local_sum(self) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for loss in self._losses:
            total += loss.float()
        return total

    def mean_loss(self, local: torch.Tensor) -> float:
        """The mean over data-parallel ranks of the last stage's value; every rank gets it.

        Only ranks holding the last stage contribute; they are world_size / pp of the
        world (every data-parallel and tensor-parallel rank of the last stage).
        """
        value = local.detach().clone() if self.has_last else torch.zeros((), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size() // self.plan.pp
        return value.item()

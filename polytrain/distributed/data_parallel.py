"""Data parallelism and ZeRO behind one small strategy interface the trainer talks to.

    dp = build_data_parallel(runtime, cfg.parallel)   # strategies.py: which strategy for the config
    model = dp.parallelize(model)                     # on the meta device, before materialize
    optimizer = dp.build_optimizer(model, cfg.train)  # after materialize; its param_groups carry the lr
    for i, batch in enumerate(micro_batches):
        dp.before_micro_batch(model, last=i == len(micro_batches) - 1)
        loss(batch).backward()
    grad_norm = dp.clip_grad_norm_(max_norm)          # the true global norm, before clipping
    dp.step(); dp.zero_grad()
    dp.state_dict() / dp.load_state_dict(sd)          # {"model", "optim"} in get_state_dict's keys
    dp.close()                                        # at the end: e.g. delete nvme offload's files

Two implementations:
- `FSDP2DataParallel`, zero = 0 or 3 (and the single process): FSDP2 `fully_shard` on
  the (dp_replicate, dp_shard) mesh (with context parallelism, cp flattened into one of
  them: ParallelDims.grad_mesh). zero = 0 puts every rank on dp_replicate:
  full parameters everywhere, gradients all-reduced (DDP semantics). zero = 3 shards
  parameters, gradients and optimizer state over dp_shard: each block is
  all-gathered just before its forward and backward and freed after, gradients are
  reduce-scattered.
- `ZeroDataParallel` (zero.py), zero = 1 or 2: replicated plain parameters, sharded
  fp32 masters and optimizer state (stage 1), and gradients (stage 2); with
  `parallel.offload` those live and step on the host or in files (offload.py), also
  on a single rank.

16-bit model states (train.precision bf16/fp16 without train.autocast_only): FSDP2 keeps
its sharded (zero 3) or replicated (zero 0) parameters in fp32 as the optimizer's masters
and computes with 16-bit copies (MixedPrecisionPolicy: all-gathered in 16 bits, gradients
reduced and kept in fp32, also summed over micro-batches in fp32); ZeroDataParallel computes
with 16-bit replicas beside its fp32 master shards and sums their gradients in fp32 unless
train.grad_accum_dtype = "param" (zero.py). A single data-parallel rank uses ZeroDataParallel for its masters whatever
parallel.zero says (with one rank the stages differ only in when gradients are copied).

With pipeline parallelism (pp > 1) each of the rank's stages gets its own strategy (by
the same rules) behind `PipelineDataParallel` (pipeline/chunks.py).
"""

from __future__ import annotations

from typing import Collection, Protocol

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from polytrain.config import TrainConfig
from polytrain.distributed.reduce_scatter import HostReduceScatter, HostAllGather
from polytrain.distributed.runtime import Runtime
from polytrain.optim.builder import build_optimizer
from polytrain.optim.clip import clip_coefficient, global_norm, squared_norm_share


class DataParallel(Protocol):
    """What the trainer, the checkpointer and later engines need from a data-parallel strategy."""

    optimizer: torch.optim.Optimizer | None

    def parallelize(self, model: nn.Module) -> nn.Module: ...
    def build_optimizer(self, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer: ...
    def before_micro_batch(self, model: nn.Module, last: bool) -> None: ...
    def gradients(self) -> list[torch.Tensor]: ...
    def clip_grad_norm_(self, max_norm: float) -> float: ...
    def step(self) -> None: ...
    def zero_grad(self) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state_dict: dict) -> None: ...
    def close(self) -> None: ...


def shard_unit(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool, reduce_by_all_reduce: bool,
               param_dtype: torch.dtype = torch.float32, offload: str = "none", pin: bool = False) -> FSDPModule:
    """`fully_shard` one FSDP2 unit; `reduce_by_all_reduce`: the backend's reduce-scatter is
    slower than its all-reduce (the accelerator says), so gradients are reduced by the latter.

    16-bit `param_dtype`: the unit computes with 16-bit copies of its fp32 sharded
    parameters and reduces (and keeps) gradients in fp32. Forward inputs are not cast:
    the residual stream is whatever the 16-bit layers make of it, as under ZeRO-1/2.
    `offload` "cpu" (or "nvme", whose files hold the host shards): FSDP2's CPU offload,
    the sharded parameters, gradients and optimizer step on the host, each unit's shards
    copied to the device for its all-gathers; `pin`: page-locked host shards (not with
    nvme, which frees and regrows their storage).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    policy = CPUOffloadPolicy(pin_memory=pin and offload == "cpu") if offload != "none" else OffloadPolicy()
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=mp if param_dtype != torch.float32 else MixedPrecisionPolicy(), offload_policy=policy)
    if reduce_by_all_reduce:  # the host backend: its collectives also have a shared-memory path
        module.set_custom_reduce_scatter(HostReduceScatter())
        module.set_custom_all_gather(HostAllGather())
    return module


class FSDP2DataParallel:
    """zero = 0 (replicas) or 3 (sharded) through FSDP2; a plain model and optimizer when dp = 1.

    `pipelined`: the module is a pipeline stage, run by a schedule over many micro-batches.
    """

    def __init__(self, runtime: Runtime, pipelined: bool = False, param_dtype: torch.dtype = torch.float32,
                 offload: str = "none"):
        self.runtime, self.pipelined, self.param_dtype, self.offload = runtime, pipelined, param_dtype, offload
        self.dims, self.mesh = runtime.dims, runtime.mesh
        # Where materialize puts the (sharded) parameters: FSDP2's CPU offload wants them on the host.
        self.param_device = torch.device("cpu") if offload != "none" else None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Shard/replicate `model` (still on meta) over the data-parallel mesh axes; in place.

        Each transformer block is its own FSDP unit so only one block's full
        parameters exist at a time; the root unit holds the embedding, final norm
        and output head.
        """
        self.model = model
        if self.dims.grad_ranks == 1:
            return model
        dp_mesh = self.dims.grad_mesh(self.mesh)  # dp (x cp: its ranks' gradients are summed too)
        by_all_reduce = self.runtime.acc.reduce_scatter_by_all_reduce
        unit_options = (self.param_dtype, self.offload, self.runtime.acc.pin_memory_available())
        if not isinstance(getattr(model, "layers", None), nn.ModuleDict):
            # A model without a `layers` dict of blocks (a user's, through polytrain.initialize)
            # is one unit, gathered whole for forward and backward: ZeRO-3 then saves optimizer
            # and gradient memory, but not the peak of the parameters.
            shard_unit(model, dp_mesh, self.dims.zero == 3, by_all_reduce, *unit_options)
            return model
        # Re-gathering after forward is what saves ZeRO-3 its memory; with full
        # replicas there is nothing to free. Two exceptions keep blocks gathered:
        # the last block, since backward starts with it (freeing it would only cost
        # one more all-gather at once), and a pipeline stage's blocks through the step
        # (as torchtitan does): a schedule interleaves the forwards and backwards of
        # many micro-batches, and zero-bubble's weight-gradient pass needs the
        # gathered parameters its input-gradient pass saw. A stage is 1/pp of the
        # model, and it is resharded after its last backward.
        blocks = list(model.layers.values())
        for i, block in enumerate(blocks):
            reshard = self.dims.zero == 3 and not self.pipelined and i < len(blocks) - 1
            shard_unit(block, dp_mesh, reshard, by_all_reduce, *unit_options)
        # The root's parameters (embedding, head) are needed again right at the start
        # of backward, so they stay gathered after forward.
        shard_unit(model, dp_mesh, False, by_all_reduce, *unit_options)
        return model

    def build_optimizer(self, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
        self.model = model
        self.optimizer = build_optimizer(model, cfg)
        return self.optimizer

    def named_optimizer_params(self) -> list[tuple[str, torch.Tensor]]:
        """(FQN, tensor the optimizer steps) pairs: the parameters themselves."""
        return list(self.model.named_parameters())

    def before_micro_batch(self, model: nn.Module, last: bool) -> None:
        """Reduce gradients across ranks only when needed during gradient accumulation.

        Replicas sync once, on the last micro-batch. ZeRO-3 reduce-scatters every
        micro-batch: holding unsharded gradients until the end would cost the full
        model's gradient memory that sharding exists to avoid.
        """
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(last or self.dims.zero == 3)

    def gradients(self) -> list[torch.Tensor]:
        """This rank's gradients (DTensor shards or replicas when dp > 1)."""
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def squared_norm_share(self, leave_out: Collection[str] = ()) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (see optim/clip.py); no communication.

        Summed over all ranks it is the squared norm of the whole model's gradient,
        whatever mix of data-parallel and tensor-parallel shards and replicas the
        gradients are; pipeline stages add their shares to the same all-reduce.
        `leave_out`: parameter names not counted (a pipeline's copy of a tied weight,
        whose gradient the original's already counts).
        """
        grads = [p.grad for n, p in self.model.named_parameters() if p.grad is not None and n not in leave_out]
        stage_ranks = self.dims.world_size // self.dims.pp
        return squared_norm_share(grads, stage_ranks, self.compute_device)

    @property
    def compute_device(self) -> torch.device:
        """Where the model computes and collectives run (offloaded shards sit on the host)."""
        return self.runtime.device

    @torch.no_grad()
    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient by `factor` (clipping by a norm computed elsewhere)."""
        # The local pieces, in one multi-tensor multiply: no DTensor dispatch per tensor.
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in self.model.parameters() if p.grad is not None]
        if local:
            if isinstance(factor, torch.Tensor):  # offloaded gradients are on the host, the norm
                factor = factor.to(local[0].device)  # (and so the factor) on the compute device
            torch._foreach_mul_(local, factor)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so their global norm is at most `max_norm`; return the norm before.

        The shares above summed by one scalar all-reduce, then a local multiply: no DTensor
        op, whose sharding propagation on a 3-4 axis mesh (a 2d grid x dp) takes minutes
        on a layout's first step, and which all-reduces once per mesh axis.
        """
        norm = global_norm(self.squared_norm_share())
        self.scale_gradients(clip_coefficient(norm, max_norm))
        return norm.item()

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])

    def close(self) -> None:
        """Nothing outlives the run."""

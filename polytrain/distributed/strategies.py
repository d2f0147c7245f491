"""Which data-parallel strategy a model gets: the ZeRO stage, the precision of its model states, offload.

    dp = build_data_parallel(runtime, cfg.parallel, run_dir, param_dtype=param_dtype_of(cfg.train),
                             accum_dtype=grad_accum_dtype_of(cfg.train))

The strategies themselves are in data_parallel.py (FSDP2, for zero 0 and 3), zero.py
(ZeRO-1/2, and 16-bit states on one rank), zero3_offload.py (ZeRO-3 with nvme offload)
and pipeline/chunks.py (one of these per pipeline stage); see data_parallel.py's
docstring for the interface they share.
"""

from __future__ import annotations

from pathlib import Path

import torch

from polytrain.config import ParallelConfig, TrainConfig
from polytrain.distributed.data_parallel import DataParallel, FSDP2DataParallel
from polytrain.distributed.offload import ShardStore
from polytrain.distributed.runtime import Runtime
from polytrain.distributed.zero import ZeroDataParallel
from polytrain.distributed.zero3_offload import NvmeFSDP2DataParallel


def param_dtype_of(train: TrainConfig) -> torch.dtype:
    """The dtype of the compute weights and their gradients: 16-bit in bf16/fp16 runs, whose optimizer
    keeps fp32 masters, unless train.autocast_only keeps fp32 weights and autocasts only the matmuls."""
    if train.precision == "fp32" or train.autocast_only:
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[train.precision]


def grad_accum_dtype_of(train: TrainConfig) -> torch.dtype:
    """What ZeRO-1/2 (and one rank) sum 16-bit gradients in over micro-batches: fp32, or the
    compute weights' own dtype with train.grad_accum_dtype = "param" (FSDP2, zero 0/3, always fp32)."""
    return torch.float32 if train.grad_accum_dtype == "fp32" else param_dtype_of(train)


def build_data_parallel(runtime: Runtime, cfg: ParallelConfig, run_dir: Path | None = None,
                        param_dtype: torch.dtype = torch.float32,
                        accum_dtype: torch.dtype = torch.float32) -> DataParallel:
    """The strategy for `parallel.zero`, `param_dtype` and `accum_dtype` (see the module docstring).

    One data-parallel rank in fp32 gets a plain optimizer unless offloading. `run_dir` is
    where nvme offload's files go when `parallel.nvme_path` is empty (<run dir>/offload);
    without it, a fresh temp directory.
    """
    if runtime.dims.pp > 1:
        from polytrain.distributed.pipeline.chunks import PipelineDataParallel

        return PipelineDataParallel(
            lambda: _strategy(runtime, cfg, run_dir, param_dtype, accum_dtype, pipelined=True), runtime.mesh["pp"])
    return _strategy(runtime, cfg, run_dir, param_dtype, accum_dtype)


def _strategy(runtime: Runtime, cfg: ParallelConfig, run_dir: Path | None, param_dtype: torch.dtype,
              accum_dtype: torch.dtype, pipelined: bool = False) -> DataParallel:
    """The strategy for one model (or pipeline stage)."""
    dims, mesh = runtime.dims, runtime.mesh
    zero12, mixed = dims.zero in (1, 2), param_dtype != torch.float32
    nvme_dir = cfg.nvme_path or (Path(run_dir) / "offload" if run_dir is not None else None)
    if dims.zero == 3 and zero3_offload(cfg) == "nvme":
        return NvmeFSDP2DataParallel(runtime, nvme_dir, param_dtype=param_dtype)
    if zero12 and (dims.grad_ranks > 1 or cfg.offload != "none") or mixed and dims.grad_ranks == 1:
        store = ShardStore(cfg.offload, nvme_dir, runtime.world.rank, pin=runtime.acc.pin_memory_available())
        # ParallelDims puts all data-parallel ranks on dp_shard for these stages (x cp: zero_mesh).
        dp_mesh = dims.zero_mesh(mesh) if dims.grad_ranks > 1 else None
        return ZeroDataParallel(runtime.acc, dp_mesh, dims.zero if zero12 else 1, int(cfg.reduce_bucket_mb * 2**20),
                                store, param_dtype=param_dtype, pipelined=pipelined, tp=dims.tp,
                                auto_buckets=cfg.reduce_bucket_auto, accum_dtype=accum_dtype)
    offload = zero3_offload(cfg) if dims.zero == 3 else "none"
    return FSDP2DataParallel(runtime, pipelined=pipelined, param_dtype=param_dtype, offload=offload)


def zero3_offload(cfg: ParallelConfig) -> str:
    """Where ZeRO-3 keeps its sharded state: its fp32 shards are the optimizer's masters, so
    parallel.offload_params and parallel.offload (checked to agree) both move them."""
    return cfg.offload_params if cfg.offload_params != "none" else cfg.offload

"""The Hybrid Engine: a training model leaves its layout to generate, and comes back.

    engine = HybridEngine(runtime, cfg, built.model, inference_tp=1, gather_blocks=0)
    new = engine.generate(prompts, max_new_tokens, temperature=0.0)   # this rank's prompts
    engine.phases    # seconds and peak memory of the last call's gather and generate phases
    with engine.generation_model() as actor: ...    # the gathered copy for a rollout loop of one's own

Generating through a ZeRO-3 model gathers every block again for every token (FSDP2 unshards
each unit per forward); DeepSpeed's Hybrid Engine instead switches the actor into an
inference layout once per rollout. Here, per `generate` call:

1. gather: `gather_blocks` blocks at a time (0 = the whole model at once; a few when memory
   is short, as DeepSpeed's tp_gather_partition_size), each block's FSDP unit is unsharded
   (one all-gather over dp), every parameter's full value taken (its tensor-parallel shards
   gathered) and the unit resharded; LoRA adapters are fused into their
   weights (W + alpha / r * B A, in fp32), and the value is written into a fresh plain model
   of the same architecture, in the dtype the actor computes in (its 16-bit copies in
   bf16 / fp16 runs, so the copy takes half an fp32 one's memory and generates as the
   actor's forward computes): whole, or split over `inference_tp` ranks by the
   architecture's plan (only this rank's slice is kept);
2. generate: polytrain's KV-cached `generate` over the batch of left-padded prompts (each row
   from its own seeded generator when given `row_seeds`); with inference_tp > 1 the ranks of
   an inference tp group first all-gather their prompts, generate the union together and
   each keeps its own rows;
3. release: the generation model and its KV cache are dropped. The training model is only
   read, so the next training step runs in its own layout unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from polytrain.config import Config, ParallelConfig
from polytrain.distributed.runtime import Runtime
from polytrain.distributed.strategies import param_dtype_of
from polytrain.distributed.tensor_parallel import parallelize_model
from polytrain.distributed.topology import ParallelDims
from polytrain.errors import ConfigError
from polytrain.inference.generate import generate
from polytrain.lora import lora_record, merge_state
from polytrain.models import ARCHITECTURES


class HybridEngine:
    """Generation for a built (training-layout) decoder through a gathered inference copy."""

    def __init__(self, runtime: Runtime, cfg: Config, model: nn.Module, inference_tp: int = 1,
                 gather_blocks: int = 0):
        """Collective (all ranks): builds the inference layout's mesh once when inference_tp > 1."""
        arch = ARCHITECTURES[cfg.model.arch]
        if arch.kind != "decoder" or runtime.dims.pp > 1:
            raise ConfigError("the hybrid engine generates with decoders in one pipeline stage "
                              f"(model.arch = '{cfg.model.arch}', parallel.pp = {runtime.dims.pp})")
        if inference_tp > 1 and runtime.dims.tp > 1:
            raise ConfigError(f"an inference tp of {inference_tp} re-splits a ZeRO-3 / replicated actor; "
                              f"this one trains at parallel.tp = {runtime.dims.tp}: set the inference tp to 1")
        if gather_blocks < 0:
            raise ConfigError(f"gather_blocks = {gather_blocks} must be >= 0 (0 = every block at once)")
        self.runtime, self.cfg, self.model, self.gather_blocks = runtime, cfg, model, gather_blocks
        self.lora = lora_record(cfg.lora)
        self.inference = None  # the inference layout's runtime (inference_tp > 1)
        if inference_tp > 1:
            dims = ParallelDims.from_config(ParallelConfig(tp=inference_tp), runtime.world.world_size)
            self.inference = runtime.with_dims(dims)
        self.phases: dict[str, dict[str, float]] = {}

    # ----- the switch -----------------------------------------------------------------

    def _groups(self) -> Iterator[tuple[list[nn.Module], list[str]]]:
        """(FSDP units, parameter names) of the training model in gathering groups: the root's
        own parameters, then `gather_blocks` blocks at a time (no units without ZeRO-3 / dp)."""
        names = [n for n, _ in self.model.named_parameters()]
        blocks: dict[str, list[str]] = {}
        for n in names:
            if n.startswith("layers."):
                blocks.setdefault(n.split(".")[1], []).append(n)
        units = [self.model] if isinstance(self.model, FSDPModule) else []
        yield units, [n for n in names if not n.startswith("layers.")]
        per = self.gather_blocks or len(blocks) or 1
        keys = list(blocks)
        for i in range(0, len(keys), per):
            group = keys[i:i + per]
            units = [self.model.layers[k] for k in group if isinstance(self.model.layers[k], FSDPModule)]
            yield units, [n for k in group for n in blocks[k]]

    @torch.no_grad()
    def gathered_model(self) -> nn.Module:
        """A plain (or inference-tp) copy of the model with its adapters fused; collective."""
        arch = ARCHITECTURES[self.cfg.model.arch]
        with torch.device("meta"):
            copy = arch.build(self.cfg.model).to(param_dtype_of(self.cfg.train))
        if self.inference is not None:
            parallelize_model(copy, arch.tp_plan(self.cfg.model), self.inference)
        copy.to_empty(device=self.runtime.device)
        copy.init_buffers()
        targets = dict(copy.named_parameters())
        for units, group in self._groups():
            # One all-gather over dp per FSDP unit, all of the group's in flight together; the
            # tensor-parallel shards are gathered per tensor. Every rank gets each global value.
            for handle in [unit.unshard(async_op=True) for unit in units]:
                if handle is not None:
                    handle.wait()
            params = dict(self.model.named_parameters())  # the unsharded ones now, for this group
            full = {n: _full(params[n]) for n in group}
            for unit in units:
                unit.reshard()
            if self.lora is not None:
                full = merge_state(full, self.lora)
            for name, value in full.items():
                _write(targets[name], value)
            del full
        return copy.eval()

    @contextlib.contextmanager
    def generation_model(self) -> Iterator[nn.Module]:
        """The gathered copy for the block (e.g. a caller's own rollout loop), released after it;
        records the gather phase's seconds and peak memory in `phases`. Collective."""
        acc = self.runtime.acc
        acc.reset_peak_memory()
        start = time.perf_counter()
        copy = self.gathered_model()
        acc.synchronize()
        self.phases = {"gather": {"s": time.perf_counter() - start, "peak_gb": acc.memory_stats()["peak_gb"]}}
        acc.reset_peak_memory()
        try:
            yield copy
        finally:
            del copy  # the gathered weights go; generate's KV cache went with its call
            gc.collect()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, row_seeds: list[int] | None = None,
                 **sampling) -> list[list[int]]:
        """This rank's prompts continued through the gathered copy (see `generate` for `sampling`);
        `row_seeds[b]` seeds row b's own generator (so its tokens do not depend on its batch or
        on the layout). Collective over every rank, each with its own prompts; `phases` gets the
        generate phase too."""
        with self.generation_model() as copy:
            start = time.perf_counter()
            seeds = row_seeds if row_seeds is not None else [None] * len(prompts)
            rows, mine = self.group_rows(list(zip(prompts, seeds)))
            if row_seeds is not None:
                device = self.runtime.device
                sampling["row_generators"] = [torch.Generator(device=device).manual_seed(s) for _, s in rows]
            new = generate(copy, [p for p, _ in rows], max_new_tokens, **sampling)[mine]
            self.runtime.acc.synchronize()
            self.phases["generate"] = {"s": time.perf_counter() - start, "tokens": sum(len(t) for t in new),
                                       "peak_gb": self.runtime.acc.memory_stats()["peak_gb"]}
        return new

    def group_rows(self, rows: list) -> tuple[list, slice]:
        """The rows (any picklable per-row items) the inference tp group generates together, in rank
        order, and the slice of them that is this rank's; `rows` itself at inference tp 1."""
        if self.inference is None:
            return rows, slice(None)
        group = self.inference.mesh["tp"].get_group()
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, rows, group=group)
        me = self.inference.mesh["tp"].get_local_rank()
        start = sum(len(r) for r in everyone[:me])
        return [r for rs in everyone for r in rs], slice(start, start + len(rows))


def _full(param: torch.Tensor) -> torch.Tensor:
    """A parameter's global value on every rank, in storage of its own (all-gathered from its
    shards when it is a DTensor; copied otherwise, since resharding frees an unsharded unit's)."""
    return param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()


def _write(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a global `value` into `param`, keeping only this rank's slice of a DTensor."""
    if isinstance(param, DTensor):
        local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(value)


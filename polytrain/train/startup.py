"""The start-up check: one place that decides whether a config runs on a world, and how.

    layout = plan_layout(cfg, world_size)      # ConfigError (one line: key and fix) if it cannot
    layout.dims, layout.batch, layout.pipeline
    runtime, layout = start(cfg)               # join the job, check, build the mesh

`plan_layout` is pure: the command line calls it before it starts any worker, and every
worker calls it again through `start` (the same function, so the checks cannot drift).
It runs the degree arithmetic (ParallelDims), the tensor- and context-parallel checks
against the model and the sequence, the offload path, the batch divisibility, and the pipeline plan, and freezes the
result; everything after start-up reads the layout instead of re-deriving it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polytrain.backend import get_accelerator
from polytrain.config import Config, TrainConfig
from polytrain.data.batch_schedule import check_batch_schedule
from polytrain.data.objectives import span_counts
from polytrain.distributed.context_parallel.checks import check_cp_config
from polytrain.distributed.strategies import zero3_offload
from polytrain.distributed.offload import check_nvme_path
from polytrain.distributed.pipeline.plan import PipelinePlan, plan_from_config
from polytrain.distributed.runtime import Runtime
from polytrain.distributed.tensor_parallel.checks import SplitRules, check_tensor_parallel
from polytrain.distributed.topology import ParallelDims
from polytrain.distributed.world import init_world
from polytrain.errors import ConfigError
from polytrain.lora import target_names
from polytrain.models import ARCHITECTURES


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch of one optimizer step is cut up (sequences, not tokens)."""

    micro_batch_size: int
    """Sequences per forward/backward on one rank."""
    accum_steps: int
    """Micro-batches each data-parallel rank runs per optimizer step."""
    dp: int
    """Data-parallel ranks, each reading its own share of the batch."""
    global_batch_size: int
    """micro_batch_size x accum_steps x dp."""

    @property
    def local_batch_size(self) -> int:
        """Sequences one data-parallel rank reads per optimizer step."""
        return self.micro_batch_size * self.accum_steps

    def micro_batches(self, local: list[int]) -> list[list[int]]:
        """This rank's sample indices of a step, cut into its micro-batches."""
        mbs = self.micro_batch_size
        return [local[i:i + mbs] for i in range(0, len(local), mbs)]


@dataclass(frozen=True)
class Layout:
    """A config checked against a world size: degrees, batch plan, pipeline plan (None without pp)."""

    dims: ParallelDims
    batch: BatchPlan
    pipeline: PipelinePlan | None


def plan_batch(t: TrainConfig, dp: int) -> BatchPlan:
    """The batch plan of `t` over `dp` ranks, or one line with the batch sizes that would fit."""
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        options = sorted({max(per_step, t.global_batch_size // per_step * per_step),
                          (t.global_batch_size // per_step + 1) * per_step})
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size x dp = {t.micro_batch_size} x {dp} = {per_step}; "
            f"set it to {' or '.join(map(str, options))}, or lower train.micro_batch_size"
        )
    return BatchPlan(t.micro_batch_size, t.global_batch_size // per_step, dp, t.global_batch_size)


def split_rules(cfg: Config) -> SplitRules:
    """What the tensor-parallel checks need to know of this config's architecture."""
    arch = ARCHITECTURES[cfg.model.arch]
    if arch.kind != "encoder-decoder":
        return SplitRules(shares_kv_heads=arch.tp_shares_kv_heads, grid_layers=cfg.model.arch == "llama")
    d = cfg.data

    def span_lengths(seq_len: int) -> tuple[int, int]:
        """(encoder, decoder) input lengths of span corruption of `seq_len`-token windows."""
        noise, spans = span_counts(seq_len, d.mask_fraction, d.mean_span_length)
        return seq_len - noise + spans, noise + spans + 1

    # The grid layers implement the roles a Llama plan uses; the other architectures'
    # extra roles (biases, position tables, packed wqkv, cross-attention) are 1d only.
    return SplitRules(shares_kv_heads=arch.tp_shares_kv_heads, grid_layers=False, stream_lengths=span_lengths)


def plan_layout(cfg: Config, world_size: int) -> Layout:
    """Check `cfg` against `world_size` processes; the frozen layout, or one ConfigError line."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    check_tensor_parallel(cfg, dims.dp, split_rules(cfg))  # tp against the model, the sequence, ZeRO
    check_cp_config(cfg, ARCHITECTURES[cfg.model.arch].kind)  # cp against the sequence, heads, other axes
    p = cfg.parallel
    if "nvme" in (p.offload, p.offload_params) and p.nvme_path:
        check_nvme_path(p.nvme_path)  # here, not at load: another machine may read the config
    if dims.zero == 3 and zero3_offload(p) != "none" and dims.dp_shard < 2:
        raise ConfigError(f"ZeRO-3 offload shards the model over {dims.dp_shard} rank(s) (parallel.zero_shard); "
                          f"it needs at least 2 (parallel.nproc >= 2), or use parallel.zero = 2 with "
                          f"parallel.offload on one process")
    batch = plan_batch(cfg.train, dims.dp)
    arch = ARCHITECTURES[cfg.model.arch]
    if p.pp > 1 and arch.kind != "decoder":
        # The schedule computes the causal LM loss from the data's targets itself; masked LM
        # and span corruption build their inputs in the trainer's objective, which it bypasses.
        raise ConfigError(f"parallel.pp > 1 runs decoders only (the causal LM objective); model.arch = "
                          f"'{cfg.model.arch}' is an {arch.kind} model: set parallel.pp = 1 and use "
                          f"parallel.tp / parallel.dp")
    if cfg.model.head == "value" and (p.pp > 1 or p.tp > 1 and p.tp_mode != "1d"):
        # The scalar head has a 1d tensor-parallel role only, and a pipeline's last stage computes the LM loss.
        raise ConfigError(f"model.head = 'value' runs with parallel.pp = 1 and tp_mode '1d' (now pp {p.pp}, "
                          f"tp_mode '{p.tp_mode}'); use parallel.dp, zero and 1d tp for reward models and critics")
    pipeline = plan_from_config(cfg, dims.dp, arch.embedding_units, arch.head_units)
    check_batch_schedule(cfg, dims.dp, pipeline)  # every ramp-up size splits on this layout too
    if cfg.lora.rank:
        check_lora(cfg, dims)
    return Layout(dims, batch, pipeline)


def check_lora(cfg: Config, dims: ParallelDims) -> None:
    """The adapters' targets exist in the model and its tensor-parallel mode can split them."""
    if dims.tp > 1 and dims.tp_mode != "1d":
        raise ConfigError(f"lora adapters split with parallel.tp_mode = '1d' only, not '{dims.tp_mode}'; "
                          "set parallel.tp_mode = '1d' or lora.rank = 0")
    with torch.device("meta"):
        target_names(ARCHITECTURES[cfg.model.arch].build(cfg.model), cfg.lora.targets)


def start(cfg: Config) -> tuple[Runtime, Layout]:
    """Join the job the environment describes (or run alone), check `cfg` on it, build the mesh."""
    acc = get_accelerator()
    world = init_world(acc)
    layout = plan_layout(cfg, world.world_size)
    return Runtime.create(acc, world, layout.dims), layout

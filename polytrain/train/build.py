"""The model builder: a parallelized, materialized model for a runtime, from any caller.

    runtime, layout = start(cfg)
    built = build_model(runtime, cfg, layout.pipeline)
    optimizer = built.dp.build_optimizer(built.model, cfg.train)
    loss = built.loss(built.model, args, targets)            # or built.pipeline.train_step(...)

The order, on the meta device until the last step (so no rank ever holds the whole model
unless its layout keeps it whole):

    build (registry) -> chunked loss head -> pipeline split -> LoRA adapters -> context
    parallel -> tensor/sequence parallel -> fp32 attention / host attention kernel / fp32 matmuls
    -> compiled blocks -> activation checkpointing ->
    data parallel / ZeRO -> real weights (seeded by name)
    [-> tied copies, autocast and the runner, for pipelines]

The trainer, `polytrain.initialize` and later engines (RLHF's four models) all build
through here; two models with different layouts (`runtime.with_dims(...)`) may be built
in one process on the same world.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from polytrain.config import Config
from polytrain.distributed.activation_checkpoint import apply_activation_checkpointing
from polytrain.distributed.context_parallel import ContextParallel
from polytrain.distributed.context_parallel.apply import parallelize_context
from polytrain.distributed.data_parallel import DataParallel
from polytrain.distributed.materialize import materialize
from polytrain.distributed.pipeline import PipelinePlan, PipelineRunner, split_model
from polytrain.distributed.pipeline.build import StageShapes, build_pipeline
from polytrain.distributed.runtime import Runtime
from polytrain.distributed.strategies import build_data_parallel, grad_accum_dtype_of, param_dtype_of
from polytrain.distributed.tensor_parallel import Context, parallelize_model
from polytrain.errors import ConfigError
from polytrain.lora import adapter_parameter_count, apply_lora
from polytrain.models import ARCHITECTURES
from polytrain.models.common.attention import Attention
from polytrain.train.attention_fp32 import attention_in_fp32, wanted
from polytrain.train.compiled import CompileTimer, compile_blocks, compiled_backend
from polytrain.train.fp32_gemm import linears_on_onednn
from polytrain.train.fp32_gemm import wanted as wants_onednn
from polytrain.train.host_attention import attention_on_kernel, why_not
from polytrain.train.host_attention import wanted as wants_host_attention
from polytrain.train.loss import (
    ContextParallelLoss,
    ModelLoss,
    attach_loss_head,
    deferred_loss,
    logits_loss_for,
    scoring_head,
    sharded_logits_loss,
)
from polytrain.train.matmul_fp32 import linears_in_fp32
from polytrain.train.matmul_fp32 import wanted as wants_fp32_matmuls

AUTOCAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class WeightInit:
    """How the data-parallel strategy wants its model materialized (see materialize.py)."""

    seed: int
    round_to: torch.dtype | None
    """16-bit model states: the dtype the initial values pass through."""
    param_device: torch.device | None
    """Where the parameters go when not to the compute device (offloaded shards: the host)."""
    materialize: Callable
    """materialize.py's, or the strategy's own (ZeRO-3 nvme offload: unit by unit)."""

    def __call__(self, module: nn.Module, device: torch.device, init_as: dict[str, str] | None = None) -> None:
        self.materialize(module, device, self.seed, init_as=init_as, round_to=self.round_to,
                         param_device=self.param_device)


@dataclass
class BuiltModel:
    """A model ready to train on this rank, with what drives it."""

    model: nn.Module
    """The model, or under pipeline parallelism an nn.ModuleDict of this rank's stages
    ({global stage index: pruned model}) that `pipeline` runs."""
    dp: DataParallel
    """Its data-parallel strategy: build_optimizer, gradient sync, clipping, step, state dict."""
    loss: ModelLoss | None
    """A micro-batch's mean loss (None for a user's model, whose forward computes its own, and
    for a value model, whose loss is its caller's: rlhf's reward and value losses)."""
    pipeline: PipelineRunner | None
    tp_ctx: Context | None
    """What its tensor-parallel layers share (None without tp)."""
    cp: ContextParallel | None
    """Its context-parallel attention (None unless parallel.cp > 1 or data.packed_documents): the
    loss shards each batch through it, generation runs over it (inference/cp_generate.py)."""
    num_params: int
    """Parameters of the whole model, whatever part of it this rank holds (without LoRA adapters)."""
    flops_per_token: float
    num_adapter_params: int = 0
    """Parameters the LoRA adapters add to the whole model (0 without lora.rank)."""
    compile_timer: CompileTimer | None = None
    """Compile time, graphs and graph breaks of this process since the blocks were compiled (train.compile)."""
    fp32_attention: bool = False
    """Whether its attention cores run in fp32 inside 16-bit training (train.attention_fp32)."""
    fp32_matmuls: bool = False
    """Whether its Linear layers' and loss head's products run as fp32 GEMMs (train.matmul_fp32)."""
    host_attention: bool = False
    """Whether its attention cores run on the host CPU's flash kernel (train.host_attention)."""
    onednn_products: bool = False
    """Whether its fp32 products run on oneDNN rather than the BLAS (train.fp32_gemm)."""


def fp32_attention(cfg: Config, model: nn.Module, device: torch.device, cp: ContextParallel | None) -> bool:
    """Whether `cfg.train.attention_fp32` runs `model`'s attention cores in fp32 on `device`: never
    under context parallelism (refused at validation when asked for)."""
    head_dims = {m.head_dim for m in model.modules() if isinstance(m, Attention)}
    return cp is None and wanted(cfg.train.attention_fp32, AUTOCAST[cfg.train.precision], device.type, head_dims,
                                 cfg.data.seq_len)


def host_attention(cfg: Config, model: nn.Module, device: torch.device, cp: ContextParallel | None) -> bool:
    """Whether `cfg.train.host_attention` runs `model`'s attention cores on the host CPU's flash kernel
    on `device`: never under context parallelism, whose cores exchange k and v themselves."""
    setting, dtype = cfg.train.host_attention, AUTOCAST[cfg.train.precision]
    head_dims = {m.head_dim for m in model.modules() if isinstance(m, Attention)}
    if setting == "true":
        reason = "parallel.cp > 1 attends across ranks" if cp is not None and cfg.parallel.cp > 1 else (
            why_not(dtype, device.type, head_dims))
        if reason:
            raise ConfigError(f"train.host_attention = true cannot run here: {reason}; use auto or false")
    return cp is None and wants_host_attention(setting, dtype, device.type, head_dims, cfg.data.seq_len)


@dataclass(frozen=True)
class HostPaths:
    """Which of the host's faster paths a model's layers take: train.attention_fp32,
    train.host_attention, train.matmul_fp32 and train.fp32_gemm as they resolve on a device
    (all off on GPUs under `auto`). The trainer's build and benchmarks that build a model
    themselves (gpu_mfu.py) route through this one place."""

    fp32_attention: bool = False
    host_attention: bool = False
    fp32_matmuls: bool = False
    onednn_products: bool = False

    @classmethod
    def chosen(cls, cfg: Config, model: nn.Module, device: torch.device, cp: ContextParallel | None) -> HostPaths:
        dtype = AUTOCAST[cfg.train.precision]
        return cls(fp32_attention(cfg, model, device, cp), host_attention(cfg, model, device, cp),
                   wants_fp32_matmuls(cfg.train.matmul_fp32, dtype, device.type),
                   wants_onednn(cfg.train.fp32_gemm, dtype, device.type))

    def apply(self, stage: nn.Module) -> None:
        """Put the paths in place in `stage`: after tensor and context parallelism, before
        compilation (a compiled block traces what they leave) and recomputation."""
        if self.fp32_attention:
            attention_in_fp32(stage)  # compiled and recomputed with the casts
        if self.host_attention:
            attention_on_kernel(stage)  # in front of the (fp32) core, which keeps the calls it cannot take
        if self.fp32_matmuls:
            linears_in_fp32(stage)  # tp's sharded layers keep their own products, taking the fp32 ones
        if self.onednn_products:
            linears_on_onednn(stage)  # likewise (fp32 models only: never with linears_in_fp32)


def build_model(runtime: Runtime, cfg: Config, pipeline: PipelinePlan | None = None,
                run_dir: Path | None = None, eot_id: int | None = None) -> BuiltModel:
    """`cfg.model` from the registry, laid out by `runtime` (and `pipeline`, the layout's plan).

    `cfg.train` picks activation checkpointing, the chunked loss and the pipeline's autocast;
    `cfg.parallel` the data-parallel strategy; `cfg.lora` the adapters (on each stage, before
    tensor parallelism splits them with their base weights); `run_dir` holds nvme offload
    files by default; `eot_id` is the end-of-text id that ends packed documents
    (data.packed_documents).
    """
    if cfg.data.packed_documents and eot_id is None:
        raise ValueError("data.packed_documents needs build_model(..., eot_id=) to find the documents")
    eot_id = eot_id if cfg.data.packed_documents else None
    arch = ARCHITECTURES[cfg.model.arch]
    with torch.device("meta"):
        model = arch.build(cfg.model)
    num_params, flops = model.num_params(), model.flops_per_token(cfg.data.seq_len)
    adapters = adapter_parameter_count(model, cfg.lora) if cfg.lora.rank else 0
    lm = cfg.model.head == "lm"  # a value model (reward model, critic) returns values: no LM loss head
    # Before the split: the last stage copies it.
    chunked = attach_loss_head(model, cfg.train, runtime.dims) if lm else False
    stages = split_model(model, pipeline, runtime.axis_rank("pp")) if pipeline else {"": model}
    if cfg.lora.rank:
        for stage in stages.values():
            apply_lora(stage, cfg.lora)
    plan = arch.tp_plan(cfg.model) if runtime.dims.tp > 1 else None
    cp = ContextParallel(runtime.cp) if runtime.cp.size > 1 or cfg.data.packed_documents else None
    tp_ctx, compiled = None, 0
    paths = HostPaths.chosen(cfg, model, runtime.device, cp)
    for stage in stages.values():
        if cp is not None:
            parallelize_context(stage, cp)  # first: tensor parallelism and checkpointing wrap its cores
        tp_ctx = parallelize_model(stage, plan, runtime)  # the same context kind on every stage
        paths.apply(stage)  # after tp (its sharded layers take the products), before compile
        compiled += compile_blocks(stage) if cfg.train.compile else 0  # tp inside, recomputation around
        apply_activation_checkpointing(stage, cfg.train.activation_checkpoint)
    timer = CompileTimer.started(compiled) if cfg.train.compile else None  # dp's hooks stay outside
    head = scoring_head(stages, pipeline, compiled_backend() if cfg.train.compile else None) if chunked else None
    dtype = AUTOCAST[cfg.train.precision]
    # 16-bit compute weights and gradients over fp32 masters, or fp32 throughout.
    param_dtype = param_dtype_of(cfg.train)
    dp = build_data_parallel(runtime, cfg.parallel, run_dir, param_dtype=param_dtype,
                             accum_dtype=grad_accum_dtype_of(cfg.train))
    model = dp.parallelize(stages if pipeline else model)
    # 16-bit states: the fp32 masters start as copies of the 16-bit initial weights.
    weights = WeightInit(cfg.run.seed, param_dtype if param_dtype != torch.float32 else None,
                         getattr(dp, "param_device", None), getattr(dp, "materialize", materialize))
    runner = None
    if pipeline:
        local_len = cfg.data.seq_len // runtime.cp.size  # a stage runs this rank's shard of each sequence
        shapes = StageShapes(cfg.train.micro_batch_size, local_len, cfg.model.dim, cfg.model.vocab_size,
                             param_dtype)
        runner = build_pipeline(model, pipeline, runtime, dp, shapes, weights=weights,
                                tied=cfg.model.tie_embeddings, autocast=lambda: runtime.acc.autocast(dtype),
                                head_scores=chunked)
    else:
        weights(model, runtime.device)
    logits_loss = logits_loss_for(tp_ctx, cfg.model.vocab_size)
    if head is not None and head.deferred:
        logits_loss = deferred_loss(head, lambda: runtime.acc.autocast(dtype))
    if not lm:  # a value model (reward model, critic): its values are scored by RLHF's losses
        loss = None
    elif cp is None:
        loss = ModelLoss(logits_loss, head)
    else:
        loss = ContextParallelLoss(ModelLoss(sharded_logits_loss(logits_loss, cp), head), cp, eot_id)
    return BuiltModel(model, dp, loss, runner, tp_ctx, cp, num_params, flops, adapters, timer, paths.fp32_attention,
                      paths.fp32_matmuls, paths.host_attention, paths.onednn_products)


def place_model(runtime: Runtime, module: nn.Module, cfg: Config, seed: int) -> BuiltModel:
    """A user's model (`polytrain.initialize`'s), on this rank's device, laid out by `cfg.parallel`.

    A model built on the meta device is materialised after sharding, as registry models are,
    so it must provide `init_parameter`/`init_buffers` (polytrain's models do). A built
    model is broadcast from rank 0, so ranks that initialised it differently agree.
    """
    on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    if on_meta and not (hasattr(module, "init_parameter") and hasattr(module, "init_buffers")):
        raise ConfigError(f"{type(module).__name__} has parameters on the meta device but no "
                          "init_parameter/init_buffers to create them; build it on the CPU")
    if not on_meta:
        module.to(runtime.device)
        _broadcast_from_rank0(module)
    dp = build_data_parallel(runtime, cfg.parallel)
    module = dp.parallelize(module)
    if on_meta:
        materialize(module, runtime.device, seed)
    num_params = sum(p.numel() for p in module.parameters())
    return BuiltModel(module, dp, None, None, None, None, num_params, 0.0)


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    # A user's model has no model-parallel axes, so the world is its data-parallel group.
    if dist.is_initialized() and dist.get_world_size() > 1:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.detach(), src=0)

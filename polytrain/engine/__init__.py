"""`polytrain.initialize`: run a DeepSpeed-style training script on polytrain by changing its import.

    engine, optimizer, loader, lr_scheduler = polytrain.initialize(
        args=cmd_args, model=model, model_parameters=model.parameters(), config="ds_config.json")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

The script may be started by torchrun, by polytrain's launcher, or as one process. The
ds_config is read by DeepSpeed's rules (polytrain.deepspeed); its ZeRO stage picks polytrain's
data-parallel strategy: replicas for 0, `distributed/zero.py` for 1 and 2, FSDP2 for 3.

Known differences from DeepSpeed: optimizer step n runs at the schedule's `lr_at(n)`, not
`lr_at(n - 1)` (see LRScheduler); weight decay applies to matrices only; a non-finite gradient
norm outside fp16 stops training (TrainingDiverged) instead of stepping; `mpu` (model
parallelism from the client) is not supported.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from polytrain.backend import get_accelerator
from polytrain.deepspeed import DeepSpeedConfigWarning, DSConfig, load_ds_config
from polytrain.distributed.runtime import Runtime
from polytrain.distributed.world import World, init_world
from polytrain.engine.build import (
    build_dataloader,
    build_optimizer,
    engine_config,
    trainable_subset,
)
from polytrain.engine.engine import Engine, EngineUsageError
from polytrain.engine.scheduler import LRScheduler
from polytrain.errors import ConfigError
from polytrain.train.build import place_model
from polytrain.train.precision import check_fp16_autocast
from polytrain.train.startup import plan_layout

__all__ = ["Engine", "EngineUsageError", "LRScheduler", "add_config_arguments", "init_distributed",
           "initialize"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--deepspeed` and `--deepspeed_config FILE` to a script's parser, as DeepSpeed does."""
    group = parser.add_argument_group("polytrain engine", "DeepSpeed-style configuration")
    group.add_argument("--deepspeed", action="store_true",
                       help="accepted for DeepSpeed scripts; the engine is always on")
    group.add_argument("--deepspeed_config", default=None, help="the ds_config.json to train with")
    return parser


def init_distributed(dist_backend: str | None = None) -> World:
    """Join the job torchrun / polytrain's launcher describes, or run as one process; idempotent.

    `dist_backend` is accepted for DeepSpeed scripts; the accelerator picks the collective library.
    """
    return init_world(get_accelerator())


def _config_source(config: Any, config_params: Any, args: Any) -> dict | str | Path:
    given = [c for c in (config, config_params) if c is not None]
    from_args = getattr(args, "deepspeed_config", None)
    if len(given) > 1 or (given and from_args is not None):
        raise ConfigError("the DeepSpeed config is given twice (config=, config_params= or "
                          "args.deepspeed_config); pass it once")
    if given:
        return given[0]
    if from_args is None:
        raise ConfigError("no DeepSpeed config: pass config= (a dict or a ds_config.json path) "
                          "or --deepspeed_config FILE")
    return from_args


def initialize(args: Any = None, model: nn.Module | None = None,
               optimizer: torch.optim.Optimizer | Callable | None = None,
               model_parameters: Iterable[Any] | None = None, training_data: Dataset | None = None,
               lr_scheduler: Any = None, mpu: Any = None, *, collate_fn: Callable | None = None,
               config: dict | str | Path | None = None, config_params: dict | None = None,
               dist_init_required: bool | None = None,
               ) -> tuple[Engine, torch.optim.Optimizer | None, Any, Any]:
    """Build (engine, optimizer, training_dataloader, lr_scheduler) as `deepspeed.initialize` does.

    - `model`: a built nn.Module (on the CPU; or on the meta device if it has
      `init_parameter`/`init_buffers`, as polytrain's models do). It is moved to this rank's
      device, made equal on all ranks (broadcast from rank 0) and laid out by the ZeRO stage.
    - `optimizer`: None to build the config's `optimizer` block through the strategy (which
      shards it under ZeRO), or, without such a block, the client's optimizer or a callable
      `params -> optimizer` (ZeRO stage 0 or 3 only).
    - `model_parameters`: the parameters (or DeepSpeed-style group dicts) the optimizer trains.
    - `lr_scheduler`: the config's `scheduler` block wins; otherwise the client's scheduler,
      or a callable `optimizer -> scheduler`. The engine steps it after each applied step.
    - `training_data`: a Dataset; the returned DataLoader reads this rank's share in
      micro-batches of train_micro_batch_size_per_gpu. Else the loader is None.
    - `config` / `config_params` / `args.deepspeed_config`: the ds_config, as a dict or a path.
    - `dist_init_required`: accepted for DeepSpeed scripts; joining the job is idempotent anyway.
    """
    if model is None:
        raise ConfigError("polytrain.initialize needs model=")
    if mpu is not None:
        raise ConfigError("mpu= (model parallelism from the client) is not supported; "
                          "polytrain's engine is data parallel")
    source = _config_source(config, config_params, args)
    acc = get_accelerator()
    world = init_world(acc)
    with warnings.catch_warnings():
        if not world.is_main:  # the list of ignored keys, once per job
            warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        ds = load_ds_config(source, world_size=world.world_size)
    cfg = engine_config(ds)
    if ds.precision == "fp16":
        check_fp16_autocast(acc)
    runtime = Runtime.create(acc, world, plan_layout(cfg, world.world_size).dims)
    seed = ds.seed if ds.seed is not None else cfg.run.seed

    trainable_subset(model, model_parameters)
    names_before = {id(p): name for name, p in model.named_parameters()}
    built = place_model(runtime, model, cfg, seed)
    model, dp = built.model, built.dp
    opt = build_optimizer(model, dp, cfg, ds.optimizer, optimizer, names_before)
    scheduler = _scheduler(ds, opt, lr_scheduler)
    loader = None
    if training_data is not None:
        loader = build_dataloader(training_data, ds.train_micro_batch_size_per_gpu, runtime.dp_rank,
                                  runtime.dp_size, seed, collate_fn)
    engine = Engine(module=model, ds=ds, dp=dp, acc=acc, world=world, device=runtime.device, optimizer=opt,
                    lr_scheduler=scheduler, training_dataloader=loader)
    return engine, opt, loader, scheduler


def _scheduler(ds: DSConfig, optimizer: torch.optim.Optimizer | None, client: Any) -> Any:
    if ds.scheduler is None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    if client is not None:
        warnings.warn("the DeepSpeed config's scheduler block wins over lr_scheduler=", stacklevel=3)
    if optimizer is None:
        raise ConfigError("the DeepSpeed config's scheduler needs an optimizer: add an optimizer "
                          "block or pass optimizer=")
    return LRScheduler(optimizer, ds.scheduler)

"""What `polytrain.initialize` builds before the engine exists, beside the model (train/build.py's
`place_model`): config, optimizer, data.

The ds_config decides everything: `load_ds_config` reads it by DeepSpeed's rules and its
`to_overrides` become polytrain's Config, which the data-parallel strategy and the optimizer
builder read; the engine reads precision, loss scaling and the schedule from the DSConfig.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from polytrain.config import Config, load_config
from polytrain.deepspeed import DSConfig, OptimizerSpec, to_overrides
from polytrain.distributed.data_parallel import DataParallel, FSDP2DataParallel
from polytrain.errors import ConfigError


def engine_config(ds: DSConfig) -> Config:
    """polytrain's Config for `ds`: what the data-parallel strategy and the optimizer builder read."""
    return load_config(None, to_overrides(ds))


def trainable_subset(model: nn.Module, model_parameters: Iterable[Any] | None) -> None:
    """Freeze the parameters `model_parameters` leaves out: the optimizer trains only the others.

    `model_parameters` is what DeepSpeed takes: parameters, or parameter-group dicts. polytrain
    groups parameters itself (decay on matrices, none on vectors), so options a group
    carries are ignored, with a warning.
    """
    if model_parameters is None:
        return
    chosen, options = set(), set()
    for item in model_parameters:
        if isinstance(item, dict):
            chosen.update(id(p) for p in item["params"])
            options.update(k for k in item if k != "params")
        else:
            chosen.add(id(item))
    owned = {id(p) for p in model.parameters()}
    if chosen - owned:
        raise ConfigError("model_parameters holds tensors that are not parameters of the model")
    if options:
        warnings.warn(f"polytrain groups parameters itself (weight decay on matrices only); the "
                      f"group options {', '.join(sorted(options))} in model_parameters are ignored",
                      stacklevel=3)
    for param in model.parameters():
        if id(param) not in chosen:
            param.requires_grad_(False)


def build_optimizer(model: nn.Module, dp: DataParallel, cfg: Config, spec: OptimizerSpec | None,
                    client: torch.optim.Optimizer | Callable | None,
                    names_before: dict[int, str]) -> torch.optim.Optimizer | None:
    """The config's optimizer, built by the strategy (ZeRO shards it), or the client's.

    `client` is an optimizer over the model's parameters as they were before `place_model`
    (FSDP replaces them; `names_before` maps them back by name), or a callable that builds
    one from parameters. None with no optimizer block: the engine then runs forward only.
    """
    if spec is not None and client is not None:
        raise ConfigError("both the DeepSpeed config's optimizer block and optimizer= give an "
                          "optimizer; keep one")
    if spec is not None:
        return dp.build_optimizer(model, cfg.train)
    if client is None:
        return None
    if not isinstance(dp, FSDP2DataParallel):
        raise ConfigError("ZeRO-1/2 steps its own sharded optimizer; describe the optimizer in "
                          "the DeepSpeed config's optimizer block instead of passing optimizer=")
    if isinstance(client, torch.optim.Optimizer):
        if client.state:
            raise ConfigError("optimizer= has already taken steps; pass a fresh optimizer")
        now = dict(model.named_parameters())
        for group in client.param_groups:
            group["params"] = [now[names_before[id(p)]] for p in group["params"]]
        optimizer = client
    else:
        optimizer = client(model.parameters())
    dp.model, dp.optimizer = model, optimizer
    return optimizer


def build_dataloader(data: Dataset, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                     collate_fn: Callable | None) -> DataLoader:
    """Micro-batches of this rank's share of `data`; `loader.sampler.set_epoch(e)` reshuffles."""
    sampler = DistributedSampler(data, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=seed)
    return DataLoader(data, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn)

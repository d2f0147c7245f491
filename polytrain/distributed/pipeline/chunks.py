"""One data-parallel strategy per pipeline stage on this rank, presented to the trainer as one.

An interleaved or ZB-V rank holds several stages (chunks) that run separately, so
each gets its own data-parallel strategy: its own FSDP units and its own optimizer,
as torchtitan does. This container fans the trainer's calls out to them and adds
the pipeline's part:

- the gradient norm is sqrt(sum over every stage of its squared norm), all-reduced
  over the world so every rank clips by the same global norm;
- the state dict is the union of the stages' (their parameter names are global and
  disjoint), with the optimizer's parameter groups listing every parameter of the
  whole model in model order, identical on every rank: exactly the single-process
  checkpoint's layout, so a checkpoint moves between pipeline layouts and to and
  from one process;
- `copies` (a copy's parameter name -> the name one process knows the weight by)
  covers a weight two stages each hold (tied embeddings, see tied.py): the copy's
  gradient is left out of the norm, and its optimizer state is saved and loaded
  under the original's name, so the checkpoint keeps the single-process keys.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from polytrain.config import TrainConfig
from polytrain.optim.clip import clip_coefficient, global_norm


class _ParamGroups:
    """What the trainer reads of an optimizer (param_groups: the learning rate; state) over all stages' optimizers."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        # The group dicts themselves: setting group["lr"] reaches every stage's optimizer.
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        """Every stage optimizer's per-parameter state: the same dicts (restart_state zeroes them in place)."""
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}


class PipelineDataParallel:
    """The DataParallel interface over this rank's stages (see the module docstring).

    `make` builds a fresh strategy (one per stage); `pp_mesh` is the pipeline axis.
    """

    def __init__(self, make: Callable[[], object], pp_mesh: DeviceMesh):
        self.make, self.pp_group = make, pp_mesh.get_group()
        self.strategies: dict[int, object] = {}
        self.optimizer: _ParamGroups | None = None
        self._group_fqns: list[list[str]] | None = None  # the whole model's, per optimizer group
        self.copies: dict[str, str] = {}  # set before build_optimizer (tied.COPIES when tied)

    def parallelize(self, stages: nn.ModuleDict) -> nn.ModuleDict:
        """Apply a new strategy to each stage ({global stage index: module}), in place."""
        for key, module in stages.items():
            strategy = self.make()
            self.strategies[int(key)] = strategy
            strategy.parallelize(module)
        return stages

    def build_optimizer(self, stages: nn.ModuleDict, cfg: TrainConfig) -> _ParamGroups:
        tied = set(self.copies) | set(self.copies.values())
        for strategy in self.strategies.values():
            if hasattr(strategy, "keep_full_grads"):  # ZeRO-1/2: the tied sum needs whole gradients
                strategy.keep_full_grads = tied
        optimizers = [self.strategies[int(k)].build_optimizer(m, cfg) for k, m in stages.items()]
        self.optimizer = _ParamGroups(optimizers)
        self._group_fqns = self._whole_model_groups()
        return self.optimizer

    def _whole_model_groups(self) -> list[list[str]]:
        """Every stage's parameter names per optimizer group, in stage order (= model order).

        A collective over the pipeline group, once: each rank knows only its stages.
        """
        mine = []
        for index, strategy in self.strategies.items():
            names = {id(p): n for n, p in strategy.named_optimizer_params()}
            mine.append((index, [[names[id(p)] for p in g["params"] if names[id(p)] not in self.copies]
                                 for g in strategy.optimizer.param_groups]))
        everyone: list = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(everyone, mine, group=self.pp_group)
        by_stage = sorted(item for rank_items in everyone for item in rank_items)
        n_groups = len(by_stage[0][1])
        return [[name for _, groups in by_stage for name in groups[g]] for g in range(n_groups)]

    def before_micro_batch(self, model: nn.Module, last: bool) -> None:
        """Nothing: the pipeline schedule defers gradient reduction to each stage's last backward itself."""

    def accumulated_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The step's gradient of `param` so far, from the stage strategy holding it (ZeRO-1/2 may
        sum 16-bit gradients in fp32 outside `param.grad`); `param.grad` elsewhere."""
        # A strategy not holding `param` answers param.grad, None while the holder sums it elsewhere.
        found = (s.accumulated_grad(param) for s in self.strategies.values() if hasattr(s, "accumulated_grad"))
        return next((grad for grad in found if grad is not None), param.grad)

    def gradients(self) -> list[torch.Tensor]:
        return [g for s in self.strategies.values() for g in s.gradients()]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every stage's gradients by the norm over the whole model; returns that norm."""
        # A copy's gradient equals its original's after the tied sum: counted once, by the original.
        share = torch.stack([s.squared_norm_share(leave_out=self.copies) for s in self.strategies.values()]).sum()
        norm = global_norm(share)  # all-reduced over the world: the pipeline stages add up
        coef = clip_coefficient(norm, max_norm)
        for strategy in self.strategies.values():
            strategy.scale_gradients(coef)
        return norm.item()

    def step(self) -> None:
        for strategy in self.strategies.values():
            strategy.step()

    def zero_grad(self) -> None:
        for strategy in self.strategies.values():
            strategy.zero_grad()

    def state_dict(self) -> dict:
        """{"model": FQN -> tensor, "optim": {"state": FQN -> ..., "param_groups": whole-model groups}}."""
        model, state, groups = {}, {}, None
        for strategy in self.strategies.values():
            sd = strategy.state_dict()
            model.update(sd["model"])
            for name, value in sd["optim"]["state"].items():  # a copy's state equals its original's
                state.setdefault(self.copies.get(name, name), value)
            groups = groups or sd["optim"]["param_groups"]
        groups = [{**g, "params": list(names)} for g, names in zip(groups, self._group_fqns, strict=True)]
        return {"model": model, "optim": {"state": state, "param_groups": groups}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Hand each stage its own entries of a (filled) `state_dict()`."""
        model, optim = state_dict["model"], state_dict["optim"]
        for strategy in self.strategies.values():
            keys = list(strategy.model.state_dict())
            # This stage's parameter names -> the names their optimizer state is saved under.
            saved = {n: self.copies.get(n, n) for n, _ in strategy.model.named_parameters()}
            groups = [{**g, "params": [n for n, s in saved.items() if s in g["params"]]} for g in optim["param_groups"]]
            state = {n: optim["state"][s] for n, s in saved.items() if s in optim["state"]}
            for n in state.keys() & self.copies.keys():
                # Its own tensors: an optimizer keeps the tensors it loads, and the
                # original's optimizer may load the same ones on this rank (ZB-V).
                state[n] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state[n].items()}
            strategy.load_state_dict({
                "model": {k: model[k] for k in keys},
                "optim": {"state": state, "param_groups": groups},
            })

    def close(self) -> None:
        for strategy in self.strategies.values():
            strategy.close()

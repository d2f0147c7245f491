"""ZeRO-3 with its sharded state in files (`parallel.offload_params nvme`, ZeRO-Infinity's NVMe offload).

FSDP2 runs the units as usual (each block one unit, the root the rest), with its CPU
offload policy: the sharded fp32 parameters, which are also the optimizer's masters, sit
on the host, are copied to the device for each all-gather, and gradients come back to
the host. On top of that every unit's host shards live in files, one per unit and kind:

    unit<u>_param.f32       the padded fp32 shards of the unit's parameters (FSDP2's _sharded_param_data)
    unit<u>_grad.f32        their gradients, summed over the step's micro-batches
    unit<u>_<state>.f32     the optimizer's per-element state (exp_avg, exp_avg_sq; momentum_buffer)

A unit's parameter shards are read into memory just before FSDP2 all-gathers them (in
forward, and again in backward for units resharded after forward) and dropped as soon
as the all-gather has copied them; the read of the unit expected next (the order of the
previous pass) starts then, on BlockIO's threads, so it overlaps this unit's compute.
After each micro-batch's reduce-scatter the unit's gradient shards are added to the
summed ones in the file and dropped, and their squared norm kept for clipping. The
optimizer steps one unit at a time, on the host where the state is: parameters,
gradients and state of unit u are read (unit u + 1's read already started), stepped,
and written back. So a rank holds a few units' shards at a time, whatever the model's
size; parameter, gradient and optimizer state of the rest stay in the files.

Checkpoints: `state_dict()` presents the files as memory-mapped tensors (DTensors with
FSDP2's sharded specs), which Distributed Checkpoint streams to and from, so the same
checkpoint loads at any other layout.

The storage of a dropped shard is resized to 0 bytes and re-grown before the next read;
the tensors (FSDP2's, the optimizer's) keep their identity throughout. This reaches into
FSDP2's per-unit parameter groups (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py):
their `unshard` and `post_backward` are wrapped per instance.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import tempfile
import weakref
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from polytrain.config import TrainConfig
from polytrain.distributed.block_io import BlockIO
from polytrain.distributed.data_parallel import FSDP2DataParallel
from polytrain.distributed.materialize import init_parameter, place_buffers
from polytrain.distributed.offload import fresh_state, state_names
from polytrain.distributed.runtime import Runtime
from polytrain.optim.builder import build_optimizer
from polytrain.optim.clip import squared_norm_share

F32 = 4  # bytes per element of every file


def _map_large_allocations() -> None:
    """Have glibc map each allocation of 1 MiB or more on its own, so a dropped shard's memory returns to the OS.

    By default glibc raises that threshold each time it frees a large mapped block, up to
    32 MiB; shards below it then come from the heap, where freed memory stays resident
    and a rank would keep every unit it ever loaded. Setting it fixes it (process-wide).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator decides
        return
    m_mmap_threshold = -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, 1 << 20)


def _drop(tensor: torch.Tensor) -> None:
    """Free a tensor's memory but keep the tensor (and its views); `_regrow` gives it back."""
    tensor.untyped_storage().resize_(0)


def _regrow(tensor: torch.Tensor, nbytes: int) -> None:
    if tensor.untyped_storage().nbytes() != nbytes:
        tensor.untyped_storage().resize_(nbytes)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class Unit:
    """One FSDP2 unit's sharded tensors and their places in the unit's files."""

    def __init__(self, index: int, module: nn.Module, io: BlockIO):
        self.index, self.module, self.io = index, module, io
        self.group = module._get_fsdp_state()._fsdp_param_group
        self.fsdp_params = list(self.group.fsdp_params)
        self.offsets, total = [], 0
        for fp in self.fsdp_params:  # every kind at the offsets of the padded parameter shards
            self.offsets.append(total)
            total += math.prod(fp.padded_sharded_param_size) * F32
        self.nbytes = total
        self.files = {kind: io.file(f"unit{index}_{kind}.f32", total) for kind in ("param", "grad")}
        self.param_read: Future | None = None  # parameters being read back
        self.resident = True  # parameter shards in memory
        self.has_grads = False  # the grad file holds this step's sum so far
        self.jobs: list[tuple[Future, list[torch.Tensor]]] = []  # reads and writes in flight, with their tensors
        self.squares: dict[str, torch.Tensor] = {}  # FQN -> this rank's share of its squared gradient norm

    @property
    def data(self) -> list[torch.Tensor]:
        """The padded flat fp32 parameter shards (P,), FSDP2's storage."""
        return [fp._sharded_param_data for fp in self.fsdp_params]

    @property
    def trainable(self) -> list[int]:
        """Positions of the parameters that train (a LoRA base is frozen: no gradient, no state)."""
        return [i for i, fp in enumerate(self.fsdp_params) if fp.sharded_param.requires_grad]

    def regions(self, tensors: list[torch.Tensor],
                positions: list[int] | None = None) -> list[tuple[torch.Tensor, int]]:
        """(tensor, byte offset in the unit's files) for the parameters at `positions` (default: all)."""
        offsets = self.offsets if positions is None else [self.offsets[i] for i in positions]
        return list(zip(tensors, offsets, strict=True))

    def wait(self) -> None:
        """Until this unit's reads and writes are done."""
        for future, _ in self.jobs:
            future.result()
        self.jobs.clear()

    def read(self, kind: str, tensors: list[torch.Tensor], positions: list[int] | None = None) -> None:
        self.jobs.append((self.io.read(self.files[kind], self.regions(tensors, positions)), tensors))

    def write(self, kind: str, tensors: list[torch.Tensor], positions: list[int] | None = None) -> None:
        self.jobs.append((self.io.write(self.files[kind], self.regions(tensors, positions)), tensors))

    # ----- parameters -----

    def start_param_read(self) -> None:
        if self.resident or self.param_read is not None:
            return
        for t in self.data:
            _regrow(t, t.numel() * F32)
        self.param_read = self.io.read(self.files["param"], self.regions(self.data))

    def load_params(self) -> None:
        self.start_param_read()
        if self.param_read is not None:
            self.param_read.result()
            self.param_read = None
        self.resident = True

    def drop_params(self) -> None:
        """Free the parameter shards (the file holds their current values)."""
        self.wait()
        for t in self.data:
            _drop(t)
        self.resident = False


class NvmeFSDP2DataParallel(FSDP2DataParallel):
    """ZeRO-3 over dp with parameters, gradients and optimizer state in files (see the module docstring).

    `nvme_dir`: where this rank's directory of files goes (a fresh temp directory under it).
    """

    def __init__(self, runtime: Runtime, nvme_dir: str | Path | None, param_dtype: torch.dtype = torch.float32):
        super().__init__(runtime, param_dtype=param_dtype, offload="nvme")
        _map_large_allocations()
        if nvme_dir is not None:
            Path(nvme_dir).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"rank{runtime.world.rank}-zero3-", dir=nvme_dir))
        self._remove = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
        self.io = BlockIO(self.dir)
        self.units: list[Unit] = []
        self._order: list[int] = []  # unit indices in the order the last pass unsharded them
        self._seen: list[int] = []  # ... and this pass so far
        self._factor: torch.Tensor | None = None
        self.kinds: tuple[str, ...] = ()

    # ----- set-up -----

    def _make_units(self, model: nn.Module) -> None:
        """One Unit per FSDP2 module, the root (index 0) first, then the blocks in order."""
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.units = [Unit(index, module, self.io) for index, module in enumerate(fsdp_modules)]

    @torch.no_grad()
    def materialize(self, model: nn.Module, device: torch.device, seed: int, init_as: dict[str, str] | None = None,
                    round_to: torch.dtype | None = None, param_device: torch.device | None = None) -> None:
        """materialize.py's, one unit at a time: allocate its shards on the host, initialise them,
        write them to the unit's file and free them, so start-up never holds more than one unit.

        Each unit's parameters are allocated by their own modules (not recursing into
        other units), and FSDP2 re-pads its shards there and then, not at its lazy init.
        """
        self.model = model
        names = {(id(module), key): f"{prefix}.{key}" if prefix else key
                 for prefix, module in model.named_modules() for key in module._parameters}
        self._make_units(model)
        for unit in self.units:
            owners = {id(fp._module_info.module): fp._module_info.module for fp in unit.fsdp_params}
            for module in owners.values():
                module.to_empty(device=torch.device("cpu"), recurse=False)
            for fp in unit.fsdp_params:
                fp.reset_sharded_param()
                info = fp._module_info
                init_parameter(model, names[(id(info.module), info.param_name)], fp.sharded_param, seed,
                               init_as, round_to)
            unit.group._reset_sharded_params = True  # done: FSDP2's lazy init would re-pad dropped shards
            unit.write("param", unit.data)
            unit.drop_params()
        place_buffers(model, device)

    def build_optimizer(self, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
        """The optimizer over FSDP2's sharded parameters, its zero state in the units' files."""
        self.model = model
        self.optimizer = build_optimizer(model, cfg)
        self.kinds = state_names(self.optimizer)
        if not self.units:  # materialized whole (materialize.py), not unit by unit
            model._get_fsdp_state()._lazy_init()  # FSDP2 re-pads the shards here, in memory
            self._make_units(model)
            for unit in self.units:
                unit.write("param", unit.data)
                unit.drop_params()
        model._get_fsdp_state()._lazy_init()
        for unit in self.units:
            for kind in self.kinds:
                unit.files[kind] = self.io.file(f"unit{unit.index}_{kind}.f32", unit.nbytes)
            for i in unit.trainable:
                p = unit.fsdp_params[i].sharded_param
                # Zero state from the start, dropped at once: the files are zeros already.
                tensors = {name: torch.zeros_like(p) for name in self.kinds}
                self.optimizer.state[p] = fresh_state(self.optimizer, tensors)
                for t in tensors.values():
                    _drop(_local(t))
            self._wrap(unit)
        return self.optimizer

    def _wrap(self, unit: Unit) -> None:
        group, unshard, post_backward = unit.group, unit.group.unshard, unit.group.post_backward

        def unshard_from_files(async_op: bool = False):
            if group._all_gather_result is not None or group.is_unsharded:
                return unshard(async_op)
            unit.load_params()
            self._note_use(unit)
            result = unshard(async_op)  # the all-gather has copied the shards (into its input buffer)
            unit.drop_params()
            return result

        def post_backward_to_files(*args):
            result = post_backward(*args)
            self._store_gradients(unit)
            return result

        group.unshard = unshard_from_files
        group.post_backward = post_backward_to_files

    def _note_use(self, unit: Unit) -> None:
        """Record the unshard order and start reading the unit the last pass used next."""
        if unit.index == 0 and self._seen:  # the root starts every forward
            self._order, self._seen = self._seen, []
        self._seen.append(unit.index)
        position = len(self._seen)
        if position < len(self._order):
            self.units[self._order[position]].start_param_read()

    # ----- gradients -----

    @torch.no_grad()
    def _store_gradients(self, unit: Unit) -> None:
        """Add this micro-batch's reduced gradient shards to the unit's summed ones in its file."""
        positions = unit.trainable
        fps = [unit.fsdp_params[i] for i in positions]
        grads = [fp.sharded_param.grad for fp in fps]
        if all(g is None for g in grads):
            return
        self.runtime.acc.synchronize()  # FSDP2's reduce and its copy to the host are done
        unit.wait()  # the previous micro-batch's sum is in the file
        totals = []
        for fp, grad in zip(fps, grads):
            local = torch.zeros(fp.sharded_size) if grad is None else _local(grad).clone()
            totals.append(local)
        if unit.has_grads:
            earlier = [torch.empty_like(t) for t in totals]
            unit.read("grad", earlier, positions)
            unit.wait()
            for t, e in zip(totals, earlier):
                t.add_(e)
        unit.write("grad", totals, positions)
        stage_ranks = self.dims.world_size // self.dims.pp
        for fp, total in zip(fps, totals):
            as_dtensor = DTensor(total, fp.sharded_param._spec, requires_grad=False)
            unit.squares[fp._param_fqn] = squared_norm_share([as_dtensor], stage_ranks, self.compute_device)
            fp.sharded_param.grad = None
        unit.has_grads = True

    def gradients(self) -> list[torch.Tensor]:
        raise NotImplementedError("fp16 loss scaling needs the gradients in memory; train in bf16 "
                                  "with parallel.offload_params = nvme")

    def squared_norm_share(self, leave_out=()) -> torch.Tensor:
        """This rank's share of the squared global gradient norm, from the squares kept at reduction."""
        total = torch.zeros((), dtype=torch.float32, device=self.compute_device)
        for unit in self.units:
            for fqn, square in unit.squares.items():
                if fqn not in leave_out:
                    total += square
        return total

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        """Multiply the gradients by `factor`, when the step reads them."""
        self._factor = torch.as_tensor(factor, dtype=torch.float32)

    # ----- the step -----

    @torch.no_grad()
    def step(self) -> None:
        """Step unit by unit: read its shards, gradients and state, step, write back, drop.

        While unit u steps, unit u + 1's reads and unit u - 1's writes are in flight.
        """
        if not self.units:
            return
        for unit in self.units:
            unit.wait()
        reads = self._start_step_read(self.units[0])
        finishing = None
        for i, unit in enumerate(self.units):
            upcoming = self._start_step_read(self.units[i + 1]) if i + 1 < len(self.units) else None
            self._step_unit(unit, *reads)
            if finishing is not None:
                self._finish_unit(*finishing)
            finishing, reads = (unit, reads[1]), upcoming
        self._finish_unit(*finishing)
        self._factor = None

    def _start_step_read(self, unit: Unit) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        """Start reading a unit's parameters, summed gradients and state; (gradients, state tensors)."""
        unit.start_param_read()
        positions = unit.trainable
        fps = [unit.fsdp_params[i] for i in positions]
        grads = [torch.zeros(fp.sharded_size) for fp in fps]
        if unit.has_grads:
            unit.read("grad", grads, positions)
        state = {kind: [_local(self.optimizer.state[fp.sharded_param][kind]) for fp in fps] for kind in self.kinds}
        for kind, tensors in state.items():
            for t in tensors:
                _regrow(t, t.numel() * F32)
            unit.read(kind, tensors, positions)
        return grads, state

    def _step_unit(self, unit: Unit, grads: list[torch.Tensor], state: dict[str, list[torch.Tensor]]) -> None:
        """Step one unit's (read) shards, then start writing them back."""
        unit.load_params()
        unit.wait()  # the gradient and state reads
        positions = unit.trainable
        fps = [unit.fsdp_params[i] for i in positions]
        for fp, grad in zip(fps, grads):
            if self._factor is not None:
                grad.mul_(self._factor)
            fp.sharded_param.grad = DTensor(grad, fp.sharded_param._spec, requires_grad=False)
        self.optimizer.step()  # the other units' parameters have no gradient: skipped
        for fp in fps:
            fp.sharded_param.grad = None
        unit.write("param", unit.data)
        for kind, tensors in state.items():
            unit.write(kind, tensors, positions)
        unit.has_grads = False
        unit.squares.clear()

    @staticmethod
    def _finish_unit(unit: Unit, state: dict[str, list[torch.Tensor]]) -> None:
        """Once a stepped unit's writes are done, free its shards and state."""
        unit.drop_params()  # waits for the writes
        for tensors in state.values():
            for t in tensors:
                _drop(t)

    def zero_grad(self) -> None:
        """Gradients live in the files until the step; a skipped step forgets them."""
        for unit in self.units:
            unit.has_grads = False
            unit.squares.clear()
        self._factor = None

    # ----- checkpoints -----

    def state_dict(self) -> dict:
        """{"model", "optim"} as get_state_dict keys them, over memory maps of the files."""
        for unit in self.units:
            unit.wait()
        sharded, state = {}, {}
        for unit in self.units:
            maps = {kind: torch.from_file(str(path), shared=True, size=unit.nbytes // F32, dtype=torch.float32)
                    for kind, path in unit.files.items() if kind != "grad"}
            for fp, offset in zip(unit.fsdp_params, unit.offsets):
                p, first = fp.sharded_param, offset // F32

                def view(kind: str, p=p, first=first) -> DTensor:
                    local = maps[kind][first:first + p._local_tensor.numel()].view(p._local_tensor.shape)
                    return DTensor(local, p._spec, requires_grad=False)

                sharded[id(p)] = view("param")
                if p.requires_grad:  # a frozen (LoRA base) parameter has no optimizer state
                    step_state = self.optimizer.state[p]
                    state[fp._param_fqn] = {k: view(k) if k in self.kinds else v for k, v in step_state.items()}
        fqn_of = {id(fp.sharded_param): fp._param_fqn for u in self.units for fp in u.fsdp_params}
        model_sd = {name: sharded.get(id(t), t) for name, t in self.model.state_dict(keep_vars=True).items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        return {"model": model_sd, "optim": {"state": state, "param_groups": groups}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Distributed Checkpoint loaded the files in place; take the hyperparameters the groups saved."""
        for group, saved in zip(self.optimizer.param_groups, state_dict["optim"]["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def close(self) -> None:
        """Finish the file I/O and delete this rank's files."""
        self.io.close()
        self._remove()

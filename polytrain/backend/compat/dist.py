"""NCCL, as CUDA code names it, becomes the accelerator's collective library.

`init_process_group("nccl")`, `new_group(backend="nccl")` (and the subgroup helpers), backend
strings such as "cpu:gloo,cuda:nccl", `is_nccl_available()`, `barrier(device_ids=...)`, NCCL's
PREMUL_SUM reduce op,
DDP's and FSDP's device arguments, and DeviceMesh device types. `dist.get_backend()` still
reports the library really in use (e.g. 'gloo'): torch decides from it where collective
buffers live, so disguising it would break torch itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from polytrain.backend.compat.devices import DeviceMap
from polytrain.backend.compat.patcher import Patcher

_CUDA_LIBRARY = "nccl"  # what CUDA code asks for; RCCL on ROCm answers to the same name


def map_backend(backend: Any, dm: DeviceMap) -> Any:
    """'nccl' -> the accelerator's library; in 'dev:lib,...' lists the device too."""
    if backend is None or not isinstance(backend, str):
        return backend
    library = dm.acc.dist_backend
    parts: list[str] = []
    for part in backend.split(","):
        device, _, lib = part.strip().rpartition(":")
        lib = library if lib.lower() == _CUDA_LIBRARY else lib
        device = dm.type if device == "cuda" else device
        entry = f"{device}:{lib}" if device else lib
        if entry not in parts:  # 'cpu:gloo,cuda:nccl' on the CPU: one entry
            parts.append(entry)
    return ",".join(parts)


# Collectives that take a reduce op: (function, the argument holding its input, in place?).
PREMUL_SUM_OPS = (
    ("all_reduce", "tensor", True), ("reduce", "tensor", True),
    ("all_reduce_coalesced", "tensors", True), ("reduce_scatter", "input_list", False),
    ("reduce_scatter_tensor", "input", False), ("reduce_scatter_single", "input", False),
)


def _premul_sum_args(key: str, in_place: bool) -> Any:
    def transform(arguments: dict[str, Any]) -> None:
        op = arguments.get("op")
        if getattr(op, "op", None) != dist.ReduceOp.PREMUL_SUM:
            return  # a plain op (RedOpType) or one the library has
        factor, value = op.factor, arguments[key]
        tensors = value if isinstance(value, (list, tuple)) else [value]
        if in_place:
            for tensor in tensors:
                tensor.mul_(factor)
        else:
            scaled = [tensor * factor for tensor in tensors]
            arguments[key] = scaled if isinstance(value, (list, tuple)) else scaled[0]
        arguments["op"] = dist.ReduceOp.SUM
    return transform


def install(p: Patcher, dm: DeviceMap) -> None:
    """Patch torch.distributed so CUDA collectives reach the accelerator's library."""
    indexed = dm.indexed

    def group_args(arguments: dict[str, Any]) -> None:
        requested = arguments.get("backend")
        arguments["backend"] = map_backend(requested, dm)
        if requested != arguments["backend"] and arguments.get("pg_options") is not None:
            arguments["pg_options"] = None  # NCCL's options mean nothing to another library
        if arguments.get("device_id") is not None:
            arguments["device_id"] = dm.map(arguments["device_id"]) if indexed else None

    owners = (dist, distributed_c10d)
    for name in ("init_process_group", "new_group", "new_subgroups",
                 "new_subgroups_by_enumeration"):
        p.wrap_arguments(owners, name, group_args)

    # NCCL's PREMUL_SUM(f) (FSDP2 reduce-scatters with it once a gradient divide factor is set):
    # scale by f, then SUM, which every library has. In-place ops scale their own tensor, which
    # the collective overwrites anyway; the others reduce a scaled copy.
    for name, key, in_place in PREMUL_SUM_OPS:
        p.wrap_arguments(owners, name, _premul_sum_args(key, in_place))

    def barrier_args(arguments: dict[str, Any]) -> None:
        arguments.pop("device_ids", None)  # only NCCL takes device_ids

    p.wrap_arguments(owners, "barrier", barrier_args)

    def object_args(arguments: dict[str, Any]) -> None:
        if arguments.get("device") is not None:
            arguments["device"] = dm.map(arguments["device"])

    for name in ("broadcast_object_list", "send_object_list", "recv_object_list"):
        p.wrap_arguments(owners, name, object_args)

    # Only the public name: torch's own c10d code reads its module global as "ProcessGroupNCCL
    # exists" (inductor's timeout bump under torch.compile) and must keep the truth.
    p.set(dist, "is_nccl_available", lambda: dist.is_backend_available(dm.acc.dist_backend))

    def ddp_args(arguments: dict[str, Any]) -> None:
        for key in ("device_ids", "output_device"):
            value = arguments.get(key)
            if value is None:
                continue
            if not indexed:  # DDP wants None for modules on the CPU
                arguments[key] = None
            elif key == "device_ids":
                arguments[key] = [dm.map(d) for d in value]
            else:
                arguments[key] = dm.map(value)

    p.wrap_arguments((torch.nn.parallel.DistributedDataParallel,), "__init__", ddp_args)

    def mesh_args(arguments: dict[str, Any]) -> None:
        if arguments.get("device_type") == "cuda":
            arguments["device_type"] = dm.type

    device_mesh = torch.distributed.device_mesh
    p.wrap_arguments((device_mesh, dist), "init_device_mesh", mesh_args)
    p.wrap_arguments((device_mesh.DeviceMesh,), "__init__", mesh_args)

    def fsdp_args(arguments: dict[str, Any]) -> None:
        # FSDP refuses to guess the CPU as its device, but takes it when told.
        if arguments.get("device_id") is not None:
            arguments["device_id"] = dm.map(arguments["device_id"])
        elif not indexed:
            arguments["device_id"] = torch.device(dm.type)

    # FSDP takes seconds to import: patch it only if the program imports it.
    p.when_imported("torch.distributed.fsdp.fully_sharded_data_parallel", lambda module: (
        p.wrap_arguments((module.FullyShardedDataParallel,), "__init__", fsdp_args)))

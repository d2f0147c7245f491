"""Stand-ins for torch.cuda names the accelerator has no counterpart for.

Importing one works, so modules that merely mention it load; using it raises CompatError naming
the call and why. A name that is a type upstream stays a type (a class whose construction
raises), so `isinstance(x, torch.cuda.CUDAGraph)`, `torch.cuda.MemPool | None` annotations and
subclasses keep working; a function stays a function.
"""

from __future__ import annotations

from typing import Any

from polytrain.errors import CompatError

# Why a torch.cuda name has no counterpart, by name or by submodule.
REASONS = {
    "CUDAGraph": "CUDA graphs capture and replay GPU kernels; there is no capture to map them onto",
    "graph": "CUDA graphs capture and replay GPU kernels; there is no capture to map them onto",
    "graph_pool_handle": "CUDA graphs capture and replay GPU kernels",
    "cudart": "it calls the CUDA runtime library itself",
    "check_error": "it checks CUDA runtime error codes",
    "current_blas_handle": "it returns a cuBLAS handle",
    "current_solver_handle": "it returns a cuSOLVER handle",
    "get_gencode_flags": "it reports nvcc code-generation flags",
    "ExternalStream": "it wraps a raw cudaStream_t",
    "get_stream_from_external": "it wraps a raw cudaStream_t",
    "MemPool": "it configures CUDA's caching allocator",
    "use_mem_pool": "it configures CUDA's caching allocator",
    "CUDAPluggableAllocator": "it replaces CUDA's caching allocator",
    "change_current_allocator": "it replaces CUDA's caching allocator",
    "caching_allocator_alloc": "it allocates from CUDA's caching allocator",
    "caching_allocator_delete": "it frees into CUDA's caching allocator",
    "_record_memory_history": "it records CUDA caching-allocator history",
    "_snapshot": "it snapshots CUDA's caching allocator",
    "_dump_snapshot": "it snapshots CUDA's caching allocator",
    "nccl": "torch.cuda.nccl calls NCCL on CUDA tensors; use torch.distributed, which the shim maps",
    "jiterator": "jiterator compiles CUDA C++ at run time",
    "tunable": "TunableOp tunes cuBLAS/hipBLASLt kernels",
    "gds": "GPUDirect Storage reads files into CUDA memory",
    "green_contexts": "green contexts partition CUDA streaming multiprocessors",
    "GreenContext": "green contexts partition CUDA streaming multiprocessors",
    "sparse": "it selects cuSPARSE kernels",
}
TELEMETRY = ("utilization", "temperature", "power_draw", "clock_rate", "device_memory_used",
             "list_gpu_processes", "memory_usage")


class UnmappedAttributeError(CompatError, AttributeError):
    """Raised for a stand-in's attributes; an AttributeError too, so `hasattr` probes answer
    False instead of failing."""


def reason_for(name: str, suffix: str, target: str) -> str:
    """Why torch.cuda[.suffix].name has no counterpart on `target`."""
    if name in REASONS or suffix.split(".")[0] in REASONS:
        return REASONS.get(name) or REASONS[suffix.split(".")[0]]
    if name in TELEMETRY:
        return "it reads NVIDIA/AMD management-library telemetry"
    return f"the {target} device module has no `{name}`"


def _message(qualname: str, target: str, reason: str) -> str:
    return (f"{qualname} cannot run on {target} under polytrain's CUDA shim: {reason} "
            f"(docs/COMPAT.md lists what is mapped)")


class _UnmappedType(type):
    """Metaclass of stand-in types: their public class attributes raise too."""

    def __getattr__(cls, name: str) -> Any:  # only reached for names the class lacks
        if name.startswith("_"):
            raise AttributeError(name)
        raise UnmappedAttributeError(cls._polytrain_unmapped)


def standin(qualname: str, target: str, reason: str, real: Any) -> Any:
    """A type when `real` is one, else a function; using either raises CompatError."""
    message = _message(qualname, target, reason)
    module, _, name = qualname.rpartition(".")
    if isinstance(real, type):
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            raise CompatError(message)

        return _UnmappedType(name, (), {"__init__": __init__, "__module__": module,
                                        "__doc__": f"Unmapped on {target}: {reason}.",
                                        "_polytrain_unmapped": message})

    def unmapped(*args: Any, **kwargs: Any) -> Any:
        raise CompatError(message)

    unmapped.__name__ = unmapped.__qualname__ = name
    unmapped.__module__, unmapped.__doc__ = module, f"Unmapped on {target}: {reason}."
    return unmapped


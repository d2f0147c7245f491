"""NVIDIA GPUs through CUDA, and AMD GPUs through ROCm (torch exposes HIP as the 'cuda' device)."""

from __future__ import annotations

from types import ModuleType

import torch

from polytrain.backend.peak import Peak, datasheet_peak
from polytrain.backend.torch_device import TorchDeviceAccelerator

# The real torch.cuda, taken when polytrain.backend is first imported: the CUDA shim
# (backend/compat) imports this package before it replaces torch.cuda, so detection and the
# CUDA backend keep talking to CUDA itself even while the shim serves another device.
_CUDA = torch.cuda
_GIB = 2**30


def _tf32_enabled() -> bool:
    """Whether float32 matmuls may run on TF32 tensor cores."""
    matmul = torch.backends.cuda.matmul
    # fp32_precision reflects both the new API and set_float32_matmul_precision; reading the
    # legacy allow_tf32 raises once the new API has been used, so prefer it where it exists.
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)


class CUDAAccelerator(TorchDeviceAccelerator):
    """CUDA or ROCm GPUs; one process per GPU, picked by local rank."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"  # on ROCm torch maps this to RCCL
    # ROCm's runtime has its own, HIP_VISIBLE_DEVICES (CUDA_VISIBLE_DEVICES only as an alias of it).
    visible_devices_env = "HIP_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES"

    @classmethod
    def module(cls) -> ModuleType:
        """The real torch.cuda, even while the CUDA shim serves another device as torch.cuda."""
        return _CUDA

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when torch was built with CUDA/ROCm and sees a GPU."""
        if _CUDA.is_available():
            return None
        if not torch.backends.cuda.is_built():
            return f"this torch ({torch.__version__}) was built without CUDA or ROCm"
        return "torch sees no GPU (driver, CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES?)"

    def dump_flight_recorder(self) -> str | None:
        """NCCL's (RCCL's) Flight Recorder, where ProcessGroupNCCL records its collectives; None
        from a torch built without NCCL, which has no such function."""
        c10d = getattr(torch._C, "_distributed_c10d", None)
        dump = getattr(c10d, "_dump_nccl_trace_json", None)
        return None if dump is None else dump(True, False)  # every collective, not only the active ones

    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        """bf16 where the GPU has native bf16 (Ampere+, CDNA2+), and fp16 everywhere."""
        if _CUDA.is_bf16_supported(including_emulation=False):
            return (torch.bfloat16, torch.float16)
        return (torch.float16,)

    def datasheet_peak(self, dtype: torch.dtype) -> Peak | None:
        """Datasheet peak of the current GPU (TF32 rate for float32 when TF32 is enabled)."""
        return datasheet_peak(self.device_name(), dtype, tf32=_tf32_enabled())

    def describe(self) -> str:
        """One line for logs: GPU count, model, memory, CUDA or ROCm version and torch version."""
        props = _CUDA.get_device_properties(_CUDA.current_device())
        total_gib = props.total_memory / _GIB
        runtime = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        return (
            f"cuda: {self.device_count()} x {self.device_name()} ({total_gib:.0f} GiB), "
            f"{runtime}, torch {torch.__version__}"
        )

"""NVIDIA GPUs through CUDA, and AMD GPUs through ROCm (torch exposes HIP as the 'cuda' device)."""

from __future__ import annotations

import torch

from polytrain.backend.base import Accelerator, Timer
from polytrain.backend.flops import gpu_peak_flops

_GIB = 2**30


class CUDATimer(Timer):
    """Times a `with` block with device events, so queued kernels count even though the
    host leaves the block before they finish; reading `elapsed_s` waits for them."""

    def __init__(self) -> None:
        self._start_event = torch.cuda.Event(enable_timing=True)
        self._end_event = torch.cuda.Event(enable_timing=True)
        self._recorded = False

    def __enter__(self) -> CUDATimer:
        self._start_event.record()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end_event.record()
        self._recorded = True

    @property
    def elapsed_s(self) -> float:
        """Device seconds between entering and leaving the block (synchronizes on the end)."""
        if not self._recorded:
            raise RuntimeError("read elapsed_s after the `with timer:` block has exited")
        self._end_event.synchronize()
        return self._start_event.elapsed_time(self._end_event) / 1000


def _tf32_enabled() -> bool:
    """Whether float32 matmuls may run on TF32 tensor cores."""
    matmul = torch.backends.cuda.matmul
    # fp32_precision reflects both the new API and set_float32_matmul_precision; reading the
    # legacy allow_tf32 raises once the new API has been used, so prefer it where it exists.
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)


class CUDAAccelerator(Accelerator):
    """CUDA or ROCm GPUs; one process per GPU, picked by local rank."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"  # on ROCm torch maps this to RCCL

    @classmethod
    def is_available(cls) -> bool:
        """Whether torch was built with CUDA/ROCm and sees at least one GPU."""
        return torch.cuda.is_available()

    def device(self, local_rank: int | None = None) -> torch.device:
        """cuda:<local_rank>, or the current GPU when local_rank is None."""
        index = torch.cuda.current_device() if local_rank is None else local_rank
        return torch.device("cuda", index)

    def set_device(self, local_rank: int) -> None:
        """Bind this process to GPU `local_rank` (collectives and new tensors go there)."""
        torch.cuda.set_device(local_rank)

    def device_count(self) -> int:
        """GPUs visible to this process (after CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)."""
        return torch.cuda.device_count()

    def synchronize(self) -> None:
        """Wait for all kernels queued on the current GPU."""
        torch.cuda.synchronize()

    def manual_seed(self, seed: int) -> None:
        """Seed the current GPU's generator."""
        torch.cuda.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor | None:
        """The current GPU's generator state (a CPU ByteTensor)."""
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Restore the current GPU's generator; None (a CPU checkpoint) leaves it alone."""
        if state is not None:
            torch.cuda.set_rng_state(state)

    def memory_stats(self) -> dict[str, float]:
        """Caching-allocator figures for the current GPU, in GiB: live tensors, their peak,
        and memory held by the allocator (closer to what nvidia-smi/rocm-smi report)."""
        return {
            "allocated_gb": torch.cuda.memory_allocated() / _GIB,
            "peak_gb": torch.cuda.max_memory_allocated() / _GIB,
            "reserved_gb": torch.cuda.memory_reserved() / _GIB,
        }

    def reset_peak_memory(self) -> None:
        """Restart the allocator's peak counters for the current GPU."""
        torch.cuda.reset_peak_memory_stats()

    def timer(self) -> CUDATimer:
        """An event-based timer; see CUDATimer."""
        return CUDATimer()

    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        """bf16 where the GPU has native bf16 (Ampere+, CDNA2+), and fp16 everywhere."""
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return (torch.bfloat16, torch.float16)
        return (torch.float16,)

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Datasheet peak of the current GPU (TF32 rate for float32 when TF32 is enabled)."""
        return gpu_peak_flops(self.device_name(), dtype, tf32=_tf32_enabled())

    def pin_memory_available(self) -> bool:
        """True: CUDA and ROCm copy asynchronously from page-locked host memory."""
        return True

    def device_name(self) -> str:
        """Product name of the current GPU, e.g. 'NVIDIA H200' or 'AMD Instinct MI300X'."""
        return torch.cuda.get_device_name()

    def describe(self) -> str:
        """One line for logs: GPU count, model, memory, CUDA or ROCm version and torch version."""
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        total_gib = props.total_memory / _GIB
        runtime = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        return (
            f"cuda: {self.device_count()} x {self.device_name()} ({total_gib:.0f} GiB), "
            f"{runtime}, torch {torch.__version__}"
        )

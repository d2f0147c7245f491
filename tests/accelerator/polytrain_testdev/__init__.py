"""polytrain's test accelerator: "testdev", a PrivateUse1 device that is not the CPU.

The CPU is PyTorch's default device, so on it a tensor made without `device=`, an index built
on the host, a host-only collective or a seed given to the CPU generator alone all pass. This
device runs CPU kernels on memory the host may not read, refuses mixed-device ops with CUDA's
error and collects with "testccl", which (like NCCL) takes device tensors only: such code
fails on it as it would on a GPU (device.cpp says how).

It registers as an accelerator plugin (tests/accelerator/*.dist-info declares the entry point;
tests/accelerator on sys.path is its installation) and is never detected: only
POLYTRAIN_ACCELERATOR=testdev selects it. The device is built on first use (device.py).
"""

from __future__ import annotations

import os

from polytrain.backend import TorchDeviceAccelerator


class TestDevAccelerator(TorchDeviceAccelerator):
    """The test device through polytrain's torch.<type> backend, as a vendor's would be."""

    name = "testdev"
    device_type = "testdev"
    dist_backend = "testccl"
    vendor_module = "polytrain_testdev.loaded"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Selected only by name, so detection never picks (or builds) it."""
        if os.environ.get("POLYTRAIN_ACCELERATOR", "").strip().lower() != cls.name:
            return "the test device is used only with POLYTRAIN_ACCELERATOR=testdev"
        return super().unavailable_reason()

    @classmethod
    def is_available(cls) -> bool:
        """Whether POLYTRAIN_ACCELERATOR names it and it builds and loads."""
        return cls.unavailable_reason() is None

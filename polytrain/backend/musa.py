"""Moore Threads GPUs through torch_musa, which registers torch.musa (a PrivateUse1 device)."""

from __future__ import annotations

from polytrain.backend.torch_device import TorchDeviceAccelerator


class MUSAAccelerator(TorchDeviceAccelerator):
    """Moore Threads GPUs; collectives through MCCL, which torch_musa registers as 'mccl'."""

    name = "musa"
    device_type = "musa"
    dist_backend = "mccl"
    visible_devices_env = "MUSA_VISIBLE_DEVICES"
    vendor_module = "torch_musa"

"""Intel GPUs (Data Center GPU Max, Arc) through torch.xpu, which torch >= 2.4 ships itself."""

from __future__ import annotations

from polytrain.backend.torch_device import TorchDeviceAccelerator


class XPUAccelerator(TorchDeviceAccelerator):
    """Intel GPUs; collectives through oneCCL, built into torch.distributed as 'xccl' (torch >= 2.8)."""

    name = "xpu"
    device_type = "xpu"
    dist_backend = "xccl"
    visible_devices_env = "ZE_AFFINITY_MASK"  # Level Zero's device list

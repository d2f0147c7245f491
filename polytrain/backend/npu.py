"""Huawei Ascend NPUs through torch_npu, which registers torch.npu (a PrivateUse1 device)."""

from __future__ import annotations

from polytrain.backend.torch_device import TorchDeviceAccelerator


class NPUAccelerator(TorchDeviceAccelerator):
    """Ascend NPUs; collectives through HCCL, which torch_npu registers as 'hccl'."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    vendor_module = "torch_npu"

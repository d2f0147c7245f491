"""Cambricon MLUs through torch_mlu, which registers torch.mlu (a PrivateUse1 device)."""

from __future__ import annotations

from polytrain.backend.torch_device import TorchDeviceAccelerator


class MLUAccelerator(TorchDeviceAccelerator):
    """Cambricon MLUs; collectives through CNCL, which torch_mlu registers as 'cncl'."""

    name = "mlu"
    device_type = "mlu"
    dist_backend = "cncl"
    visible_devices_env = "MLU_VISIBLE_DEVICES"
    vendor_module = "torch_mlu"

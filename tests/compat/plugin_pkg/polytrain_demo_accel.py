"""The smallest accelerator plugin: the host CPU presented as a device called 'demo'.

A real vendor package subclasses polytrain.backend.TorchDeviceAccelerator and sets name,
device_type, dist_backend and vendor_module (docs/PORTING.md); this one borrows the CPU
backend so the test can run anywhere, and has a "device" only when POLYTRAIN_DEMO_DEVICE=1.
"""

import os

from polytrain.backend import CPUAccelerator


class DemoAccelerator(CPUAccelerator):
    name = "demo"

    @classmethod
    def is_available(cls) -> bool:
        return os.environ.get("POLYTRAIN_DEMO_DEVICE") == "1"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if cls.is_available() else "no demo device (POLYTRAIN_DEMO_DEVICE is not 1)"

"""The elastic launcher's device pool and its verdict on a failure (a real job losing a device and one
restarting after an exception: tests/distributed/test_elastic.py)."""

from __future__ import annotations

import pytest

from polytrain.backend import CPUAccelerator, CUDAAccelerator
from polytrain.errors import ConfigError
from polytrain.train.elastic_devices import Verdict, device_pool, judge_failure


def test_a_signal_loses_the_device_a_hang_or_an_exception_does_not():
    # SIGKILLed rank 1; its peers then fail in their broken collectives (exit 1): only rank 1's device is lost.
    assert judge_failure([(0, 1), (1, -9), (2, 1), (3, 1)]) == Verdict("lost", (1,))
    assert judge_failure([(3, -11), (0, -9)]) == Verdict("lost", (0, 3))
    assert judge_failure([(1, 3), (0, 3)]) == Verdict("hang")
    assert judge_failure([(2, 1)]) == Verdict("error")
    assert judge_failure([(0, 2), (1, -9)]) == Verdict("user_error")  # a config error stops the job


def test_the_pool_is_what_the_visibility_variable_lists_else_one_device_a_worker():
    assert CUDAAccelerator.visible_devices_env in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
    cpu = CPUAccelerator.visible_devices_env
    assert cpu == "POLYTRAIN_VISIBLE_DEVICES"
    assert device_pool(cpu, 3, {}) == ["0", "1", "2"]
    assert device_pool("CUDA_VISIBLE_DEVICES", 2, {"CUDA_VISIBLE_DEVICES": "4, 6,7"}) == ["4", "6"]
    assert device_pool("ZE_AFFINITY_MASK", 2, {"ZE_AFFINITY_MASK": "0.0,0.1"}) == ["0.0", "0.1"]
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES='4,5' lists 2; list 4 or more devices there, "
                                          r"or lower the MAX of parallel.nproc"):
        device_pool("CUDA_VISIBLE_DEVICES", 4, {"CUDA_VISIBLE_DEVICES": "4,5"})

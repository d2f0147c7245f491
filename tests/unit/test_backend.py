"""Accelerator selection, memory, timing and peak-FLOP/s on the CPU; the GPU table without a GPU."""

import json
import re
import time
from pathlib import Path

import pytest
import torch

import polytrain
from polytrain.backend import (
    ACCELERATORS,
    CPUAccelerator,
    CUDAAccelerator,
    flops,
    get_accelerator,
    gpu_peak_flops,
)


@pytest.fixture(autouse=True)
def fresh_selection(monkeypatch, tmp_path):
    """Each test chooses the accelerator anew and measures into its own cache dir."""
    monkeypatch.delenv("POLYTRAIN_ACCELERATOR", raising=False)
    monkeypatch.setenv("POLYTRAIN_CACHE", str(tmp_path / "cache"))
    get_accelerator.cache_clear()
    yield
    get_accelerator.cache_clear()


def test_auto_detection_falls_back_to_cpu(monkeypatch):
    monkeypatch.setattr(CUDAAccelerator, "is_available", classmethod(lambda cls: False))
    acc = get_accelerator()
    assert isinstance(acc, CPUAccelerator)
    assert (acc.name, acc.device_type, acc.dist_backend) == ("cpu", "cpu", "gloo")
    assert acc.device(3) == torch.device("cpu")
    assert get_accelerator() is acc  # cached


def test_env_override_selects_cpu(monkeypatch):
    monkeypatch.setenv("POLYTRAIN_ACCELERATOR", "cpu")
    assert isinstance(get_accelerator(), CPUAccelerator)


def test_unknown_name_lists_known_ones(monkeypatch):
    monkeypatch.setenv("POLYTRAIN_ACCELERATOR", "tpu9000")
    with pytest.raises(ValueError) as err:
        get_accelerator()
    for name in ACCELERATORS:
        assert name in str(err.value)


def test_unavailable_request_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(CUDAAccelerator, "unavailable_reason",
                        classmethod(lambda cls: "torch sees no GPU"))
    monkeypatch.setenv("POLYTRAIN_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match="cuda is not available in this process: torch sees no GPU"):
        get_accelerator()


def test_requesting_a_vendor_backend_without_its_package_says_so(monkeypatch):
    monkeypatch.setenv("POLYTRAIN_ACCELERATOR", "npu")
    with pytest.raises(RuntimeError, match="torch_npu is not installed"):
        get_accelerator()


def test_builtin_backends_their_order_and_collective_libraries():
    assert list(ACCELERATORS) == ["npu", "mlu", "musa", "cuda", "xpu", "mps", "cpu"]
    assert {name: cls.dist_backend for name, cls in ACCELERATORS.items()} == {
        "npu": "hccl", "mlu": "cncl", "musa": "mccl", "cuda": "nccl", "xpu": "xccl",
        "mps": "gloo", "cpu": "gloo"}
    assert {cls.vendor_module for cls in ACCELERATORS.values()} == {
        "torch_npu", "torch_mlu", "torch_musa", None}


def test_detection_takes_the_first_available_in_order(monkeypatch):
    for name in ("xpu", "mps", "npu"):
        monkeypatch.setattr(ACCELERATORS[name], "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(ACCELERATORS["npu"], "__init__", lambda self: None)
    assert get_accelerator().name == "npu"  # out-of-tree stacks before cuda, xpu, mps
    get_accelerator.cache_clear()
    monkeypatch.setattr(ACCELERATORS["npu"], "is_available", classmethod(lambda cls: False))
    assert get_accelerator().name == "xpu"


def test_probing_for_devices_imports_no_vendor_package():
    """Detection asks importlib whether torch_npu etc. exist; it imports none that is absent."""
    import sys

    for cls in ACCELERATORS.values():
        cls.is_available()
    assert not {"torch_npu", "torch_mlu", "torch_musa"} & set(sys.modules)
    for name in ("npu", "mlu", "musa"):
        assert ACCELERATORS[name].unavailable_reason() == f"torch_{name} is not installed"


def test_memory_stats_track_rss():
    acc = CPUAccelerator()
    before = acc.memory_stats()
    assert set(before) == {"allocated_gb", "peak_gb", "reserved_gb"}
    assert before["allocated_gb"] > 0
    big = torch.ones(50_000_000)  # 200 MB, pages touched
    after = acc.memory_stats()
    assert after["allocated_gb"] - before["allocated_gb"] > 0.15
    assert after["peak_gb"] >= after["allocated_gb"]
    del big
    acc.reset_peak_memory()
    assert acc.memory_stats()["peak_gb"] > 0


def test_timer_measures_a_sleep():
    with CPUAccelerator().timer() as t:
        time.sleep(0.05)
    assert 0.045 <= t.elapsed_s < 0.5


def test_autocast_float32_is_a_no_op_and_bf16_casts():
    acc = CPUAccelerator()
    assert torch.bfloat16 in acc.autocast_dtypes()
    x = torch.randn(4, 4)
    with acc.autocast(torch.float32):
        assert (x @ x).dtype == torch.float32
    with acc.autocast(torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="cannot autocast"):
        acc.autocast(torch.float64)


def test_cpu_peak_flops_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setattr(flops, "_machine_is_quiet", lambda: True)
    acc = CPUAccelerator()
    fp32 = acc.peak_flops(torch.float32)
    assert fp32 > 1e8
    cache = json.loads((tmp_path / "cache" / "peak_flops.json").read_text())
    assert any(key.endswith("torch.float32") for key in cache)

    def no_second_measurement(dtype, budget_s=0.5):
        raise AssertionError("peak_flops re-measured despite the cache")

    monkeypatch.setattr(flops, "measure_matmul_flops", no_second_measurement)
    assert acc.peak_flops(torch.float32) == fp32
    assert CPUAccelerator().peak_flops(torch.float32) == fp32  # a new process reads the file


@pytest.mark.skipif(not flops.onednn_available(), reason="this build of torch has no oneDNN")
def test_the_fp32_peak_counts_onednn_where_it_is_faster_than_the_blas(monkeypatch):
    """train.fp32_gemm runs products on oneDNN: a peak timed on a slower BLAS alone would inflate MFU."""
    real_mm = torch.mm

    def slow_blas(a, b):  # 50 ms a product: n stays 128, 2 x 128^3 FLOPs at most ~84 MFLOP/s
        time.sleep(0.05)
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", slow_blas)
    slow = 2 * 128**3 / 0.05
    assert flops.measure_matmul_flops(torch.float32, budget_s=0.2) > 10 * slow
    monkeypatch.setattr(flops, "onednn_available", lambda: False)
    assert flops.measure_matmul_flops(torch.float32, budget_s=0.2) <= slow


def test_busy_machine_measurement_is_retried_and_the_best_kept(monkeypatch, tmp_path):
    monkeypatch.setattr(flops, "_machine_is_quiet", lambda: False)
    readings = iter([1e9, 3e9, 2e9])
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype, budget_s=0.5: next(readings))
    assert flops.cpu_peak_flops(torch.float32) == 1e9
    assert flops.cpu_peak_flops(torch.float32) == 3e9  # busy: measured again, best kept
    monkeypatch.setattr(flops, "_machine_is_quiet", lambda: True)
    assert flops.cpu_peak_flops(torch.float32) == 3e9  # 2e9 now, but 3e9 was seen; settled
    assert flops.cpu_peak_flops(torch.float32) == 3e9  # no further measurement (iterator is empty)


def test_gpu_peak_flops_table():
    assert gpu_peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == 156e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA A10G", torch.bfloat16) == 70e12  # not A10 or A100
    assert gpu_peak_flops("AMD Instinct MI300X", torch.bfloat16) == 1307e12
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", torch.float16) == 125e12
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_no_vendor_names_outside_backend():
    """Only polytrain/backend/ may name a vendor API; everything else goes through Accelerator."""
    root = Path(polytrain.__file__).parent
    banned = re.compile(r"torch\.cuda|[\"']nccl[\"']")
    offenders = [
        f"{path.relative_to(root.parent)}:{lineno}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if "backend" not in path.relative_to(root).parts[:1]
        for lineno, line in enumerate(path.read_text().splitlines(), 1)
        if banned.search(line)
    ]
    assert not offenders, "vendor API outside polytrain/backend/:\n" + "\n".join(offenders)

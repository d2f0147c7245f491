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
    datasheet_peak,
    flops,
    get_accelerator,
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


def test_cpu_peak_is_measured_at_each_start_until_it_settled_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(flops, "_machine_is_quiet", lambda: True)
    fp32 = CPUAccelerator().peak(torch.float32)  # one real measurement
    assert fp32.flops > 1e8 and fp32.dtype == "fp32"
    assert fp32.source == f"measured on this CPU, best of 1 run, cached in {tmp_path / 'cache' / 'peak_flops.json'}"
    cache = json.loads((tmp_path / "cache" / "peak_flops.json").read_text())
    assert any("torch.float32" in key for key in cache)

    readings = iter([fp32.flops / 2, fp32.flops * 2])  # the next runs' measurements, each at start-up
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype, **kw: next(readings))
    acc = CPUAccelerator()
    assert acc.peak(torch.float32).flops == fp32.flops  # a lower reading does not lower it
    assert acc.peak(torch.float32).flops == fp32.flops  # once per process: not measured again
    assert CPUAccelerator().peak(torch.float32).flops == 2 * fp32.flops  # a new process measures again
    settled = CPUAccelerator().peak(torch.float32)  # SETTLED_RUNS quiet runs: read, not measured (iterator empty)
    assert settled.flops == 2 * fp32.flops and "best of 3 runs" in settled.source


@pytest.mark.skipif(not flops.onednn_available(), reason="this build of torch has no oneDNN")
def test_the_fp32_peak_counts_onednn_where_it_is_faster_than_the_blas(monkeypatch):
    """train.fp32_gemm runs products on oneDNN: a peak timed on a slower BLAS alone would inflate MFU."""
    real_mm = torch.mm

    def slow_blas(a, b):  # 0.25 s a product: n stays 1024, 2 x 1024^3 FLOPs at most ~8.6 GFLOP/s
        time.sleep(0.25)
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", slow_blas)
    slow = 2 * 1024**3 / 0.25
    assert flops.measure_matmul_flops(torch.float32, budget_s=0.2) > 3 * slow
    monkeypatch.setattr(flops, "onednn_available", lambda: False)
    assert flops.measure_matmul_flops(torch.float32, budget_s=0.2) <= slow


def test_a_busy_host_never_lowers_the_peak_and_does_not_settle_it(monkeypatch, tmp_path):
    """Measurements on a busy host come out low: they may raise the cached best, never lower it,
    and runs keep measuring until SETTLED_RUNS were taken on a quiet host (MAX_RUNS in all)."""
    real_perf_counter = time.perf_counter
    clock = {"slowdown": 1.0}

    def perf_counter():  # a busy host: every timed interval stretched by the slowdown
        return real_perf_counter() * clock["slowdown"]

    monkeypatch.setattr(flops.time, "perf_counter", perf_counter)
    monkeypatch.setattr(flops, "_machine_is_quiet", lambda: True)
    quiet = flops.measured_peak(torch.float32).flops
    monkeypatch.setattr(flops, "_machine_is_quiet", lambda: False)
    clock["slowdown"] = 20.0  # 20x slower: ~quiet / 20
    for _ in range(flops.SETTLED_RUNS - 1):
        assert flops.measured_peak(torch.float32).flops == quiet
    entry = next(iter(json.loads((tmp_path / "cache" / "peak_flops.json").read_text()).values()))
    assert entry["runs"] == flops.SETTLED_RUNS and entry["quiet_runs"] == 1  # the next run measures again
    assert entry["flops"] == quiet
    for _ in range(flops.MAX_RUNS):  # a host never quiet: measuring stops after MAX_RUNS in all
        flops.measured_peak(torch.float32)
    entry = next(iter(json.loads((tmp_path / "cache" / "peak_flops.json").read_text()).values()))
    assert entry["runs"] == flops.MAX_RUNS and entry["flops"] == quiet


def test_datasheet_peaks_by_device_name():
    """Dense figures (half the datasheets' sparse ones), by the names torch reports."""
    expected = {
        ("NVIDIA H100 80GB HBM3", torch.bfloat16): (989e12, "bf16", "H100 SXM datasheet, dense"),
        ("NVIDIA H100 PCIe", torch.bfloat16): (756e12, "bf16", "H100 PCIe datasheet, dense"),
        ("NVIDIA H200", torch.bfloat16): (989e12, "bf16", "H200 SXM datasheet, dense"),
        ("NVIDIA H20", torch.bfloat16): (148e12, "bf16", "H20 datasheet, dense"),  # not the H200
        ("NVIDIA B200", torch.bfloat16): (2.25e15, "bf16", "B200 datasheet, dense"),
        ("NVIDIA GB200", torch.float16): (2.5e15, "fp16", "GB200 datasheet, dense"),  # not the B200
        ("NVIDIA A100-SXM4-80GB", torch.float32): (19.5e12, "fp32", "A100 datasheet, dense"),
        ("NVIDIA A10G", torch.bfloat16): (70e12, "bf16", "A10G datasheet, dense"),  # not A10 or A100
        ("NVIDIA L40S", torch.bfloat16): (362e12, "bf16", "L40S datasheet, dense"),
        ("AMD Instinct MI300X", torch.bfloat16): (1307e12, "bf16", "MI300X datasheet, dense"),
        ("AMD Instinct MI355X", torch.bfloat16): (2.5e15, "bf16", "MI355X datasheet, dense"),
        ("Tesla V100-SXM2-16GB", torch.float16): (125e12, "fp16", "V100 datasheet, dense"),
    }
    for (name, dtype), (flops_, key, source) in expected.items():
        peak = datasheet_peak(name, dtype)
        assert (peak.flops, peak.dtype, peak.source, peak.cache_key) == (flops_, key, source, None), name
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True).flops == 156e12
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True).dtype == "tf32"
    assert datasheet_peak("AMD Instinct MI355X", torch.float32, tf32=True).dtype == "fp32"  # no TF32
    assert datasheet_peak("NVIDIA H100 80GB HBM3", torch.bfloat16).describe() == (
        "989 TFLOP/s bf16 (H100 SXM datasheet, dense)")
    for unknown in ("Some Future GPU", "Ascend910B2", "Intel(R) Data Center GPU Max 1550", "Apple MPS"):
        assert datasheet_peak(unknown, torch.bfloat16) is None, unknown
    assert datasheet_peak("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # no bf16 tensor cores
    assert CPUAccelerator().datasheet_peak(torch.bfloat16) is None


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


def test_timing_the_peak_leaves_the_global_random_stream_alone():
    """The peak is timed at start-up, after seeding: its operands must not draw from torch's generator."""
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    flops.measure_matmul_flops(torch.float32, budget_s=0.01)
    assert torch.equal(torch.rand(4), expected)

"""The generic torch.<type> backend (what xpu, npu, mlu and musa are), driven through a fake
vendor package, and the host device model the CUDA shim serves on the CPU."""

import sys
import time

import pytest
import torch

from polytrain.backend import TorchDeviceAccelerator, flops
from polytrain.backend.host_device import HostDevice

VENDOR = """
import torch
from polytrain.backend.host_device import HostDevice

IMPORTS = globals().get("IMPORTS", 0) + 1
# What torch_npu and friends do: add torch.<device type>, a module with torch.cuda's names.
# (They also rename the PrivateUse1 device to their name; that cannot be undone within a
# process and makes torch.accelerator report the device, so the stand-in keeps torch's name.)
torch.privateuseone = HostDevice()
"""


class FakeDevAccelerator(TorchDeviceAccelerator):
    name, device_type, dist_backend, vendor_module = "fakedev", "privateuseone", "gloo", "torch_fakedev"


@pytest.fixture
def vendor(tmp_path, monkeypatch):
    """Install the fake vendor package on sys.path, and remove what importing it adds."""
    (tmp_path / "torch_fakedev.py").write_text(VENDOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("torch_fakedev", None)
    if hasattr(torch, "privateuseone"):
        del torch.privateuseone


def test_missing_vendor_package_is_named_and_nothing_is_imported():
    assert FakeDevAccelerator.unavailable_reason() == "torch_fakedev is not installed"
    assert not FakeDevAccelerator.is_available()
    assert "torch_fakedev" not in sys.modules


def test_vendor_package_is_imported_on_first_probe_only(vendor):
    assert "torch_fakedev" not in sys.modules
    assert FakeDevAccelerator.is_available()
    assert sys.modules["torch_fakedev"].IMPORTS == 1


def test_a_broken_vendor_install_disables_only_that_backend(tmp_path, monkeypatch):
    (tmp_path / "torch_fakedev.py").write_text("raise OSError('libvendor.so: cannot open shared object file')")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert FakeDevAccelerator.unavailable_reason() == (
        "OSError: libvendor.so: cannot open shared object file")
    sys.modules.pop("torch_fakedev", None)


def test_every_accelerator_call_goes_to_the_device_module(vendor, monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    acc = FakeDevAccelerator()
    assert acc.device_module() is torch.privateuseone
    assert acc.device_count() == 2
    acc.set_device(1)
    assert torch.privateuseone.current_device() == 1
    assert acc.device() == torch.device("privateuseone", 1)
    assert acc.device(0) == torch.device("privateuseone", 0)
    acc.synchronize()
    acc.manual_seed(5)
    state = acc.get_rng_state()
    first = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    stats = acc.memory_stats()
    assert set(stats) == {"allocated_gb", "peak_gb", "reserved_gb"} and stats["peak_gb"] > 0
    acc.reset_peak_memory()
    with acc.timer() as t:
        time.sleep(0.03)
    assert 0.025 <= t.elapsed_s < 0.5
    assert acc.autocast_dtypes() == (torch.bfloat16, torch.float16)
    assert acc.device_name() == torch.privateuseone.get_device_name()
    # Not in the datasheet table: MFU is against a peak measured on the device, and says so.
    monkeypatch.setenv("POLYTRAIN_CACHE", str(tmp_path / "cache"))
    timed_on = []
    monkeypatch.setattr(flops, "measure_matmul_flops",
                        lambda dtype, device, synchronize: timed_on.append(device) or 5e12)
    peak = acc.peak(torch.bfloat16)
    assert timed_on == [torch.device("privateuseone", 1)]
    assert (peak.flops, peak.dtype) == (5e12, "bf16") and peak.cache_key is not None
    assert f"measured on this {acc.device_name()} (not in the datasheet table), best of 1 run" in peak.source


def test_host_device_presents_one_device_per_local_rank(monkeypatch):
    host = HostDevice()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert host.device_count() == 1
    with pytest.raises(RuntimeError, match=r"set_device\(1\): the host is presented as 1 device"):
        host.set_device(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    host.set_device(3)
    assert host.current_device() == 3
    with host.device(2):
        assert host.current_device() == 2
    assert host.current_device() == 3
    assert len(host.default_generators) == 4
    assert all(g is torch.default_generator for g in host.default_generators)


def test_host_events_time_and_streams_are_ordered():
    host = HostDevice()
    start, end = host.Event(enable_timing=True), host.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert 15 <= start.elapsed_time(end) < 500  # milliseconds, as CUDA's
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        host.Event().elapsed_time(end)
    side = host.Stream()
    with host.stream(side):
        assert host.current_stream() is side
        side.wait_stream(host.default_stream())
    assert host.current_stream() is host.default_stream()
    assert side.query() and side.record_event().query()


def test_host_memory_figures_follow_the_resident_set():
    host = HostDevice()
    before = host.memory_allocated()
    big = torch.ones(40_000_000)  # 160 MB, pages touched
    assert host.memory_allocated() - before > 100 * 2**20
    assert host.max_memory_allocated() >= host.memory_allocated()
    stats = host.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    free, total = host.mem_get_info()
    assert 0 < free <= total
    del big

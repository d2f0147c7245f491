"""The test device itself (tests/accelerator): what makes it catch what a GPU would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.device.conftest import TEST_DEVICE

CHECKS = r"""
import json, torch
from polytrain.backend import get_accelerator
acc = get_accelerator()
d0, d1 = acc.device(0), acc.device(1)
out = {"device": str(d0)}

def error(fn):
    try:
        fn()
    except Exception as e:
        return str(e).splitlines()[0]
    return None

x = torch.ones(4, 3, device=d0)
out["host_index"] = error(lambda: x.index_select(0, torch.tensor([0, 1])))
out["other_device"] = error(lambda: x + torch.ones(4, 3, device=d1))
out["host_output"] = error(lambda: torch.zeros(()).add_(torch.ones((), device=d0)))  # a host sum of device values
out["host_scalar"] = (x * torch.tensor(2.0)).sum().item()  # 0-dim host tensors are scalars, as on CUDA

torch.testdev.manual_seed(1)
a = torch.rand(3, device=d0)
torch.manual_seed(5)  # torch's seed reaches the device's generator too
b = torch.rand(3, device=d0)
torch.manual_seed(5)
torch.random.default_generator.manual_seed(6)  # the CPU's generator alone does not
c = torch.rand(3, device=d0)
state = torch.testdev.get_rng_state()
e = torch.rand(3, device=d0)
torch.testdev.set_rng_state(state)
f = torch.rand(3, device=d0)
out["seeded_rerun_equal"] = torch.equal(b.cpu(), c.cpu())
out["seeds_differ"] = not torch.equal(a.cpu(), b.cpu())
out["state_restored"] = torch.equal(e.cpu(), f.cpu())
g = torch.Generator(device=d0).manual_seed(3)
out["generator_device"] = str(g.device)

start, end = torch.testdev.Event(enable_timing=True), torch.testdev.Event(enable_timing=True)
start.record(); (x @ x.T).sum(); end.record(); end.synchronize()
out["elapsed_ms"] = start.elapsed_time(end)
plain = [torch.testdev.Event(), torch.testdev.Event()]
[p.record() for p in plain]
out["untimed"] = error(lambda: plain[0].elapsed_time(plain[1]))

before = torch.testdev.memory_allocated()
block = torch.empty(2**20, dtype=torch.uint8, device=d0)
out["allocated_grew"] = torch.testdev.memory_allocated() - before
with torch.autocast("testdev", dtype=torch.bfloat16):
    out["autocast"] = [str((x @ x.T).dtype), str(torch.softmax(x, -1).dtype)]
out["pinned"] = torch.ones(3).pin_memory().is_pinned()
print(json.dumps(out))
"""

HOST_READ = """
import ctypes, torch
from polytrain.backend import get_accelerator
x = torch.ones(1024, device=get_accelerator().device(0))
print(ctypes.string_at(x.data_ptr(), 4) == bytes(ctypes.c_float(1.0)), flush=True)
"""


@pytest.fixture
def test_device(on_tier) -> dict[str, str]:
    if on_tier["POLYTRAIN_ACCELERATOR"] != TEST_DEVICE:
        pytest.skip(f"checks of {TEST_DEVICE} itself")
    return {**os.environ, "PYTHONPATH": on_tier["PYTHONPATH"]}


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_it_fails_where_cuda_would_and_has_cudas_device_api(test_device):
    proc = python(CHECKS, test_device)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["device"] == "testdev:0"
    assert got["host_index"].startswith("Expected all tensors to be on the same device, but got index is on cpu")
    assert "Expected all tensors to be on the same device" in got["other_device"]
    assert "Expected all tensors to be on the same device" in got["host_output"]
    assert got["host_scalar"] == 24.0
    assert got["seeded_rerun_equal"] and got["seeds_differ"] and got["state_restored"]
    assert got["generator_device"] == "testdev:0"
    assert got["elapsed_ms"] >= 0
    assert got["untimed"] == "Both events must be created with argument 'enable_timing=True'."
    assert got["allocated_grew"] >= 2**20
    assert got["pinned"] is True
    assert got["autocast"] == ["torch.bfloat16", "torch.float32"]  # products low, softmax fp32


def test_a_host_read_of_device_memory_crashes(test_device):
    proc = python(HOST_READ, test_device)
    assert proc.returncode == -11, (proc.returncode, proc.stdout, proc.stderr[-2000:])  # SIGSEGV
    unguarded = python(HOST_READ, {**test_device, "POLYTRAIN_TESTDEV_GUARD": "0"})
    assert unguarded.returncode == 0 and unguarded.stdout.strip() == "True", unguarded.stderr[-2000:]

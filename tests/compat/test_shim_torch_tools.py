"""torch's own tools under the shim: its functions stay its own (TorchScript, inspect, FX,
Dynamo see them), every torch.cuda type stays a type, and torch._C's CUDA-only bindings are
stood in for or refused in one line."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polytrain.backend.compat import facade
from polytrain.backend.compat.standins import UnmappedAttributeError
from polytrain.errors import CompatError

ORIGINALS = {name: getattr(torch, name) for name in ("zeros", "ones", "empty", "tensor", "arange")}
METHODS = {name: getattr(torch.Tensor, name) for name in ("to", "cuda", "new_zeros", "pin_memory")}
MODULE_METHODS = {name: getattr(torch.nn.Module, name) for name in ("to", "cuda", "to_empty")}


def test_torch_functions_and_tensor_methods_are_torchs_own(shim):
    assert {name: getattr(torch, name) for name in ORIGINALS} == ORIGINALS
    assert {name: getattr(torch.Tensor, name) for name in METHODS} == METHODS
    assert {name: getattr(torch.nn.Module, name) for name in MODULE_METHODS} == MODULE_METHODS
    parameters = list(inspect.signature(torch.nn.Module.to_empty).parameters)
    assert parameters == ["self", "device", "recurse"]


def test_torchscript_compiles_functions_that_call_factories(shim):
    @torch.jit.script
    def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))) \
            + torch.zeros(x.shape, dtype=x.dtype)

    out = bias_gelu(torch.ones(3, device="cuda"), torch.zeros(3, device="cuda"))
    assert out.device.type == "cpu" and out.shape == (3,)


def test_fx_traces_calls_that_name_cuda(shim):
    class Net(torch.nn.Module):
        def forward(self, x):
            return x.to("cuda") + torch.ones(3, device="cuda")

    traced = torch.fx.symbolic_trace(Net())
    assert torch.equal(traced(torch.zeros(3)), torch.ones(3))


def test_compile_traces_through_the_mapping_with_no_graph_break():
    # In a process of its own, as `polytrain run` starts one: Dynamo's rules about torch.cuda's
    # functions are read once per process, and this test session installs the shim many times.
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "run",
                           str(Path(__file__).parent / "programs" / "compile_cuda.py")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"graphs": 1, "breaks": 0, "reasons": [],
                                                        "equal": True}


def _upstream_types():
    """(module name, name) of every public torch.cuda[.sub] name that is a type upstream."""
    for module_name in facade._facaded_modules():
        real = sys.modules[module_name].__polytrain_real__
        for name in sorted(facade._public_names(real)):
            if isinstance(getattr(real, name, None), type):
                yield module_name, name


def test_every_torch_cuda_type_stays_a_type(shim):
    found = list(_upstream_types())
    assert ("torch.cuda", "StreamContext") in found and ("torch.cuda", "CUDAGraph") in found
    for module_name, name in found:
        value = getattr(sys.modules[module_name], name)
        assert isinstance(value, type), f"{module_name}.{name} is {value!r}"
        assert not isinstance(object(), value)
        assert (value | None) is not None  # usable in annotations

    class Captured(torch.cuda.CUDAGraph):  # a library's subclass defines fine ...
        pass

    with pytest.raises(CompatError, match=r"torch\.cuda\.CUDAGraph cannot run on cpu"):
        Captured()  # ... and fails, naming the type, when used
    with pytest.raises(CompatError, match=r"torch\.cuda\.MemPool"):
        torch.cuda.MemPool()
    assert not hasattr(torch.cuda.graphs.CUDAGraph, "replay")  # probes answer, not raise
    with pytest.raises(UnmappedAttributeError, match="CUDA graphs"):
        torch.cuda.CUDAGraph.replay
    with torch.cuda.StreamContext(torch.cuda.Stream()) as entered:
        assert entered is None and isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
    assert isinstance(torch.cuda.current_stream(), torch.Stream)


def test_cuda_only_bindings_stand_in_or_fail_in_one_line(shim):
    assert torch._C._cuda_getCurrentRawStream(0) == 0  # the default stream's handle
    torch._C._cuda_setDevice(1)
    assert torch._C._cuda_getDevice() == torch.cuda.current_device() == 1
    torch._C._cuda_setDevice(0)
    assert not hasattr(torch._C, "_cuda_getDeviceCount")  # torch's "built with CUDA" probe
    assert not torch.cuda._is_compiled()
    with pytest.raises(UnmappedAttributeError, match=r"torch\._C\._cuda_cudaHostAllocator is a "
                       r"CUDA-only binding of torch and cpu has no counterpart; tests called it"):
        torch._C._cuda_cudaHostAllocator
    with pytest.raises(AttributeError, match="no attribute '_no_such_binding'"):
        torch._C._no_such_binding


def test_mapping_reaches_backward_callbacks_and_new_threads(shim):
    import threading

    class AllGatherLike(torch.autograd.Function):  # Megatron-style: allocates in backward
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2 + torch.zeros(grad.shape, device=torch.cuda.current_device())

    param = torch.nn.Parameter(torch.ones(3, device="cuda"))
    seen = []
    param.register_post_accumulate_grad_hook(  # DeepSpeed's ZeRO bucket hook
        lambda p: seen.append(torch.empty(2, device="cuda").device.type))
    param.register_hook(lambda g: seen.append(torch.ones(1, device="cuda:0").device.type))
    AllGatherLike.apply(param).sum().backward()
    assert torch.equal(param.grad, torch.full((3,), 2.0)) and seen == ["cpu", "cpu"]

    made = []
    worker = threading.Thread(target=lambda: made.append(torch.zeros(1, device="cuda").device))
    worker.start()
    worker.join()
    assert made == [torch.device("cpu")]

"""Names imported before the shim, what it cannot map, and taking it out again."""

import importlib
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

from polytrain.backend import CPUAccelerator
from polytrain.backend.compat import install, uninstall
from polytrain.errors import CompatError, CudaExtensionImportError

EARLY = """
from torch import cuda
from torch.cuda import Event, synchronize, is_available
from torch.cuda.amp import GradScaler
from torch.distributed import init_process_group
"""


@pytest.fixture
def early_module(tmp_path, monkeypatch):
    """A module that imported CUDA names before the shim was installed."""
    (tmp_path / "early_cuda_user.py").write_text(EARLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("early_cuda_user")
    yield module
    sys.modules.pop("early_cuda_user", None)


def test_names_imported_before_the_shim_are_rebound_and_restored(early_module):
    real = dict(vars(early_module))
    install(CPUAccelerator())
    try:
        assert early_module.cuda is torch.cuda is sys.modules["torch.cuda"]
        assert early_module.is_available() and early_module.Event is torch.cuda.Event
        assert early_module.synchronize is torch.cuda.synchronize
        assert early_module.GradScaler is torch.cuda.amp.GradScaler
        assert early_module.GradScaler()._device == "cpu"
        assert early_module.init_process_group is torch.distributed.init_process_group
    finally:
        uninstall()
    for name in ("cuda", "Event", "synchronize", "is_available", "GradScaler", "init_process_group"):
        assert getattr(early_module, name) is real[name]


def test_unmappable_names_import_and_fail_clearly_when_used(shim):
    from torch.cuda import CUDAGraph  # importing a name that only CUDA has still works

    with pytest.raises(CompatError, match=r"torch\.cuda\.CUDAGraph cannot run on cpu .*CUDA graphs"):
        CUDAGraph()
    with pytest.raises(CompatError, match=r"torch\.cuda\.nccl\.version .*use torch\.distributed"):
        torch.cuda.nccl.version()
    with pytest.raises(CompatError, match=r"torch\.cuda\.utilization .*telemetry"):
        torch.cuda.utilization()
    with pytest.raises(CompatError, match=r"_record_memory_history"):
        torch.cuda.memory._record_memory_history(max_entries=10)
    # Graphs only speed up replay, so graphed callables run eagerly.
    fn = torch.nn.Linear(2, 2)
    assert torch.cuda.make_graphed_callables(fn, (torch.ones(1, 2),)) is fn


def test_building_a_cuda_extension_names_it(shim):
    from torch.utils import cpp_extension

    with pytest.raises(CompatError, match=r"CUDA extension 'fused_adam' \(sources kernels/adam\.cu\)"):
        cpp_extension.load("fused_adam", ["kernels/adam.cpp", "kernels/adam.cu"])
    with pytest.raises(CompatError, match=r"'softmax' \(cuda_sources\) cannot be built for cpu"):
        cpp_extension.load_inline("softmax", cpp_sources="", cuda_sources="__global__ void k() {}")


@pytest.mark.skipif(not shutil.which("cc") or not sysconfig.get_paths().get("include"),
                    reason="needs a C compiler and Python headers")
def test_importing_a_compiled_cuda_extension_is_a_named_import_error(shim, tmp_path, monkeypatch):
    """An extension linked against libcudart, on a machine without it."""
    fake_cudart = tmp_path / "libcudart.so.12"
    subprocess.run(["cc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(fake_cudart)],
                   input=b"int cudaGetDeviceCount(int *n) { *n = 0; return 0; }", check=True)
    source = tmp_path / "fused_kernels.c"
    source.write_text("#include <Python.h>\nint cudaGetDeviceCount(int *);\n"
                      "static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, \"fused_kernels\"};\n"
                      "PyMODINIT_FUNC PyInit_fused_kernels(void) { int n; cudaGetDeviceCount(&n);"
                      " return PyModule_Create(&m); }\n")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(["cc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    str(source), "-o", str(tmp_path / f"fused_kernels{suffix}"),
                    str(fake_cudart)], check=True)
    fake_cudart.unlink()  # as on a machine without CUDA
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as err:  # still an ImportError: fallbacks keep working
        import fused_kernels  # noqa: F401
    assert isinstance(err.value, CudaExtensionImportError)
    assert "'fused_kernels'" in str(err.value) and "libcudart.so.12" in str(err.value)
    assert "cannot run on cpu" in str(err.value)


def test_uninstall_restores_torch():
    originals = {
        "cuda": torch.cuda, "zeros": torch.zeros, "load": torch.load,
        "init_process_group": torch.distributed.init_process_group,
        "autocast_init": torch.amp.autocast_mode.autocast.__init__,
        "amp_module": sys.modules["torch.cuda.amp"],
    }
    tensor_methods = {name: vars(torch.Tensor).get(name) for name in ("to", "cuda", "pin_memory")}
    depth = torch._C._len_torch_function_stack()
    install(CPUAccelerator())
    assert torch.cuda is not originals["cuda"]
    assert torch._C._len_torch_function_stack() == depth + 1  # the device mode
    uninstall()
    assert torch._C._len_torch_function_stack() == depth
    assert torch.cuda is originals["cuda"] is sys.modules["torch.cuda"]
    assert sys.modules["torch.cuda.amp"] is originals["amp_module"]
    assert torch.zeros is originals["zeros"] and torch.load is originals["load"]
    assert torch.distributed.init_process_group is originals["init_process_group"]
    assert torch.amp.autocast_mode.autocast.__init__ is originals["autocast_init"]
    assert {n: vars(torch.Tensor).get(n) for n in tensor_methods} == tensor_methods
    assert not torch.cuda.is_available()

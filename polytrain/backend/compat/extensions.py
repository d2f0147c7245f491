"""Compiled CUDA code cannot be mapped: say so, naming it, instead of failing deep inside.

Three ways CUDA kernels reach a program, each stopped with a CompatError that names the
extension and what to do:
- building one: `torch.utils.cpp_extension.load/load_inline` with .cu sources or
  `with_cuda=True`, and `CUDAExtension`;
- importing a prebuilt one (`import amp_C`, a .so linked against libcudart or libc10_cuda):
  the loader's "cannot open shared object file" becomes a CudaExtensionImportError, still an
  ImportError, so code that falls back to pure PyTorch when the import fails still does;
- `torch.ops.load_library` of such a library.
"""

from __future__ import annotations

import importlib.machinery
import re
from typing import Any, Callable

import torch

from polytrain.backend.compat.patcher import Patcher
from polytrain.errors import CompatError, CudaExtensionImportError

# Shared libraries only CUDA (or ROCm) programs link against.
_CUDA_LIBRARY = re.compile(
    r"\blib(cudart|cuda|cublas\w*|cudnn\w*|nvrtc\w*|cufft\w*|curand|cusparse\w*|cusolver\w*|"
    r"nccl|nvToolsExt|nvJitLink|cupti|c10_cuda|torch_cuda\w*|amdhip64|rccl|hipblas\w*|"
    r"MIOpen|c10_hip|torch_hip)\b[\w.]*")
_CUDA_SOURCE = (".cu", ".cuh")


def _advice(target: str) -> str:
    return (f"compiled CUDA kernels cannot run on {target}; use a build for {target} or the "
            f"package's pure-PyTorch path (docs/COMPAT.md)")


def install(p: Patcher, target: str) -> None:
    """Install the three guards of the module docstring."""
    loader = importlib.machinery.ExtensionFileLoader

    def create_module(original: Callable) -> Callable:
        def wrapper(self: Any, spec: Any) -> Any:
            try:
                return original(self, spec)
            except ImportError as e:
                library = _CUDA_LIBRARY.search(str(e))
                if library is None:
                    raise
                error = CudaExtensionImportError(
                    f"extension module {spec.name!r} ({spec.origin}) is compiled CUDA code: it "
                    f"needs {library[0]}. {_advice(target)}")
                error.name, error.path = spec.name, spec.origin
                raise error from e
        return wrapper

    p.wrap(loader, "create_module", create_module)

    def load_library(original: Callable) -> Callable:
        def wrapper(self: Any, path: str) -> None:
            try:
                original(self, path)
            except OSError as e:
                library = _CUDA_LIBRARY.search(str(e))
                if library is None:
                    raise
                raise CompatError(f"torch.ops.load_library({path!r}): the library is compiled "
                                  f"CUDA code (it needs {library[0]}). {_advice(target)}") from e
        return wrapper

    p.wrap(type(torch.ops), "load_library", load_library)
    # cpp_extension imports setuptools (half a second): patch it only if the program imports it.
    p.when_imported("torch.utils.cpp_extension", lambda module: _guard_builds(p, module, target))


def _guard_builds(p: Patcher, cpp_extension: Any, target: str) -> None:
    def refuse(name: str, what: str) -> None:
        raise CompatError(f"CUDA extension {name!r} ({what}) cannot be built for {target}: "
                          f"{_advice(target)}")

    def load_args(arguments: dict[str, Any]) -> None:
        sources = arguments.get("sources") or []
        sources = [sources] if isinstance(sources, str) else sources
        cuda = [s for s in sources if str(s).endswith(_CUDA_SOURCE)]
        if cuda or arguments.get("with_cuda"):
            refuse(arguments["name"], f"sources {', '.join(map(str, cuda))}" if cuda else "with_cuda=True")

    def inline_args(arguments: dict[str, Any]) -> None:
        if arguments.get("cuda_sources") or arguments.get("with_cuda"):
            refuse(arguments["name"], "cuda_sources" if arguments.get("cuda_sources") else "with_cuda=True")

    def cuda_extension_args(arguments: dict[str, Any]) -> None:
        refuse(arguments["name"], "CUDAExtension")

    p.wrap_arguments((cpp_extension,), "load", load_args)
    p.wrap_arguments((cpp_extension,), "load_inline", inline_args)
    p.wrap_arguments((cpp_extension,), "CUDAExtension", cuda_extension_args)

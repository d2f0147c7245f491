"""torch.testdev: torch.cuda's names over the test device, the ones polytrain's
TorchDeviceAccelerator and the CUDA shim (polytrain/backend/compat) call."""

from __future__ import annotations

import contextlib
import types

import torch

NAME = "testdev"


class device:  # noqa: N801 - torch.cuda.device's name
    """Context manager that makes a device current (torch.cuda.device)."""

    def __init__(self, which) -> None:
        self.index = _index(which)
        self.previous = -1

    def __enter__(self):
        self.previous = torch.accelerator.current_device_index()
        if self.index >= 0:
            torch.accelerator.set_device_index(self.index)
        return self

    def __exit__(self, *exc) -> None:
        if self.index >= 0:
            torch.accelerator.set_device_index(self.previous)


def _index(which) -> int:
    """A device index from an int, "testdev:1", a torch.device or None (the current one)."""
    if which is None:
        return torch.accelerator.current_device_index()
    if isinstance(which, int):
        return which
    which = torch.device(which)
    if which.type != NAME:
        raise ValueError(f"expected a {NAME} device, got {which}")
    return which.index if which.index is not None else torch.accelerator.current_device_index()


class _Properties:
    def __init__(self, index: int, total: int) -> None:
        self.name = f"{NAME} {index} (polytrain's test device)"
        self.total_memory = total
        self.major, self.minor = 9, 0
        self.multi_processor_count = 1


def make(ext) -> types.ModuleType:
    """The torch.testdev module over the built extension `ext`."""
    m = types.ModuleType(f"torch.{NAME}")
    m.device = device
    m.is_available = lambda: True
    m.is_initialized = lambda: True
    m.init = lambda: None
    m._is_in_bad_fork = lambda: False
    m.device_count = ext.device_count
    m.current_device = ext.current_device
    m.set_device = lambda which: ext.set_device(_index(which))
    m.synchronize = lambda which=None: None  # work is synchronous
    m.is_bf16_supported = lambda including_emulation=True: True
    m.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    m.get_device_name = lambda which=None: f"{NAME} (polytrain's test device)"
    m.get_device_capability = lambda which=None: (9, 0)
    m.get_device_properties = lambda which=None: _Properties(_index(which), 16 * 2**30)
    m.mem_get_info = lambda which=None: (16 * 2**30 - ext.memory(_index(which))[0], 16 * 2**30)

    def memory_allocated(which=None) -> int:
        return ext.memory(_index(which))[0]

    def max_memory_allocated(which=None) -> int:
        return ext.memory(_index(which))[1]

    m.memory_allocated = m.memory_reserved = memory_allocated
    m.max_memory_allocated = m.max_memory_reserved = max_memory_allocated
    m.reset_peak_memory_stats = lambda which=None: ext.reset_peak(_index(which))
    m.reset_max_memory_allocated = m.reset_peak_memory_stats
    m.empty_cache = lambda: None
    m.memory_stats = lambda which=None: {"allocated_bytes.all.current": memory_allocated(which),
                                         "allocated_bytes.all.peak": max_memory_allocated(which)}

    def generator(which=None) -> torch.Generator:
        return ext.default_generator(_index(which))

    m.default_generators = tuple(ext.default_generator(i) for i in range(ext.device_count()))
    m.manual_seed = lambda seed: generator().manual_seed(int(seed))
    m.manual_seed_all = lambda seed: [g.manual_seed(int(seed)) for g in m.default_generators]
    m.seed = lambda: generator().seed()
    m.seed_all = lambda: [g.seed() for g in m.default_generators]
    m.initial_seed = lambda: generator().initial_seed()
    m.get_rng_state = lambda which=None: generator(which).get_state()
    m.set_rng_state = lambda state, which=None: generator(which).set_state(state)
    m.get_rng_state_all = lambda: [g.get_state() for g in m.default_generators]
    m.set_rng_state_all = lambda states: [g.set_state(s) for g, s in zip(m.default_generators, states)]

    m.Event = torch.Event
    m.Stream = torch.Stream
    m.current_stream = lambda which=None: torch.accelerator.current_stream(_index(which))
    m.default_stream = lambda which=None: torch.Stream(device=torch.device(NAME, _index(which)), priority=0)
    m.set_stream = torch.accelerator.set_stream

    @contextlib.contextmanager
    def stream(s):
        """Make `s` the current stream inside the block (torch.cuda.stream)."""
        if s is None:
            yield
            return
        previous = torch.accelerator.current_stream(s.device_index)
        torch.accelerator.set_stream(s)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    m.stream = stream
    return m
